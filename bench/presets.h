// Benchmark presets: real model shapes (bench/presets.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moeflow::bench {

struct Preset {
  std::string name;
  int64_t hidden;       // H
  int64_t ffn;          // F (expert FFN width)
  int num_experts;      // E
  int topk;             // K
  int64_t num_tokens;   // T per GPU
};

const std::vector<Preset>& presets();
// Throws moeflow::Error listing the known names when `name` is unknown.
const Preset& find_preset(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace moeflow::bench
