// Expert weights in safetensors checkpoints, in both key layouts users have:
// per-expert keys (<prefix>weight0 ... weight{E-1}, each [out, in]; biases
// <prefix>bias{i}) and one grouped key (<prefix>weight [E, out, in]). Loads
// either layout into either storage (one stacked tensor, or E tensors), and
// converts a GLU weight's gate/up row order between the file's layout
// (halves, or interleaved blocks of `glu_interleave` rows as Megatron's
// glu_interleave_size) and moeflow's canonical halves layout ([gate; up]).
// Round trips are bitwise exact. All of this runs on the host (CPU tensors).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moeflow/tensor.h"

namespace moeflow {

// A safetensors file held in memory; its JSON header is parsed with
// nlohmann-json and every entry is checked (dtype, shape, byte range).
class SafetensorsFile {
 public:
  static SafetensorsFile read(const std::string& path);
  // From bytes already in memory (the whole file).
  static SafetensorsFile parse(std::vector<uint8_t> bytes, const std::string& name = "<memory>");

  bool contains(const std::string& key) const { return tensors_.count(key) != 0; }
  std::vector<std::string> keys() const;  // sorted
  // A CPU view into the file's bytes (valid while this object lives).
  TensorView view(const std::string& key) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string name_;
  std::shared_ptr<std::vector<uint8_t>> bytes_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (CPU, contiguous) as a safetensors file; keys must be unique.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
std::vector<uint8_t> serialize_safetensors(
    const std::vector<std::pair<std::string, TensorView>>& tensors,
    const std::map<std::string, std::string>& metadata = {});

enum class ExpertKeyLayout { kPerExpert, kGrouped };

// One expert parameter (a weight [out, in] or a bias [out] per expert).
struct ExpertParam {
  std::string prefix;            // e.g. "decoder.layers.0.mlp.experts.linear_fc1."
  std::string stem = "weight";   // "weight" or "bias"
  int num_experts = 0;
  std::vector<int64_t> shape;    // per expert: {out, in} or {out}
  DType dtype = DType::kBFloat16;
  // Row order of a GLU parameter (out = 2F) in the file: 0 = halves [gate; up];
  // g > 0 = blocks of g gate rows then g up rows (F must be a multiple of g).
  int glu_interleave = 0;
};

// Which key layout a file uses for `p` (throws when neither, both, or an
// incomplete / extra set of per-expert keys is found).
ExpertKeyLayout find_expert_layout(const SafetensorsFile& file, const ExpertParam& p);

// Loads `p` into canonical (halves) layout: `dst` is a CPU [E, ...shape]
// tensor view, or E CPU views of `shape`.
void load_expert_param(const SafetensorsFile& file, const ExpertParam& p, TensorView dst);
void load_expert_param(const SafetensorsFile& file, const ExpertParam& p,
                       const std::vector<TensorView>& dst);

// The (key, tensor) entries that store `src` (canonical layout, stacked
// [E, ...shape] or E views) in the given key layout and the GLU row order of p.
std::vector<std::pair<std::string, Tensor>> export_expert_param(const ExpertParam& p, TensorView src,
                                                                ExpertKeyLayout layout);
std::vector<std::pair<std::string, Tensor>> export_expert_param(const ExpertParam& p,
                                                                const std::vector<TensorView>& src,
                                                                ExpertKeyLayout layout);

}  // namespace moeflow
