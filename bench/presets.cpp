// The preset table.
#include "bench/presets.h"

#include "moeflow/error.h"

namespace moeflow::bench {

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = {
      {"mixtral", 4096, 14336, 8, 2, 16384},
      {"dsv3", 7168, 2048, 256, 8, 8192},
      {"qwen3-30b", 2048, 768, 128, 8, 16384},
      {"qwen3-235b", 4096, 1536, 128, 8, 8192},
      {"gpt-oss-120b", 2880, 2880, 128, 4, 8192},
      {"tiny", 512, 256, 16, 4, 512},  // the small default case
  };
  return kPresets;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.push_back(p.name);
  return names;
}

const Preset& find_preset(const std::string& name) {
  for (const Preset& p : presets())
    if (p.name == name) return p;
  std::string known;
  for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  MOEFLOW_CHECK(false, "--preset must be one of ", known, "; got '", name, "'");
}

}  // namespace moeflow::bench
