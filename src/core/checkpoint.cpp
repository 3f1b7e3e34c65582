// safetensors reading/writing (header parsed and written with nlohmann-json;
// the 8-byte length prefix, entry checks and byte layout written by hand) and
// the expert-parameter layouts on top: per-expert or grouped keys, GLU row
// order (halves or interleaved blocks) converted to and from the canonical
// halves layout by a row permutation. Everything is byte copies: round trips
// are bitwise exact.
#include "moeflow/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/internal.h"

namespace moeflow {

namespace {

const std::vector<std::pair<DType, const char*>> kDTypeNames = {
    {DType::kFloat32, "F32"},     {DType::kFloat16, "F16"},     {DType::kBFloat16, "BF16"},
    {DType::kFloat8E4M3, "F8_E4M3"}, {DType::kFloat8E5M2, "F8_E5M2"}, {DType::kInt32, "I32"},
    {DType::kInt64, "I64"},       {DType::kUInt8, "U8"},        {DType::kBool, "BOOL"}};

const char* st_name(DType d) {
  for (const auto& [dt, n] : kDTypeNames)
    if (dt == d) return n;
  MOEFLOW_CHECK(false, "dtype ", dtype_name(d), " has no safetensors name");
}

DType st_dtype(const std::string& s, const std::string& where) {
  for (const auto& [dt, n] : kDTypeNames)
    if (s == n) return dt;
  MOEFLOW_CHECK(false, where, ": unsupported safetensors dtype '", s, "'");
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

}  // namespace

// --- safetensors -------------------------------------------------------------

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MOEFLOW_CHECK(f.good(), "cannot open safetensors file '", path, "'");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse(std::move(bytes), path);
}

SafetensorsFile SafetensorsFile::parse(std::vector<uint8_t> bytes, const std::string& name) {
  SafetensorsFile file;
  file.name_ = name;
  file.bytes_ = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  const auto& b = *file.bytes_;
  MOEFLOW_CHECK(b.size() >= 8, name, ": not a safetensors file (", b.size(), " bytes)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | b[i];
  MOEFLOW_CHECK(header_len <= b.size() - 8, name, ": header length ", header_len, " exceeds the file (",
                b.size(), " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + static_cast<int64_t>(header_len));
  } catch (const std::exception& e) {
    MOEFLOW_CHECK(false, name, ": bad safetensors header: ", e.what());
  }
  MOEFLOW_CHECK(header.is_object(), name, ": safetensors header must be a JSON object");
  const uint64_t data_begin = 8 + header_len, data_size = b.size() - data_begin;
  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") {
      MOEFLOW_CHECK(entry.is_object(), name, ": __metadata__ must be an object");
      for (const auto& [mk, mv] : entry.items()) {
        MOEFLOW_CHECK(mv.is_string(), name, ": __metadata__ values must be strings (", mk, ")");
        file.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = name + ": tensor '" + key + "'";
    MOEFLOW_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                      entry.contains("data_offsets"),
                  where, " needs dtype, shape and data_offsets");
    const DType dt = st_dtype(entry["dtype"].get<std::string>(), where);
    std::vector<int64_t> shape;
    for (const auto& d : entry["shape"]) {
      MOEFLOW_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0, where, ": bad shape");
      shape.push_back(d.get<int64_t>());
    }
    MOEFLOW_CHECK(static_cast<int>(shape.size()) <= kMaxDims, where, ": rank ", shape.size(), " > ", kMaxDims);
    const auto& offs = entry["data_offsets"];
    MOEFLOW_CHECK(offs.is_array() && offs.size() == 2, where, ": data_offsets must be [begin, end]");
    const uint64_t lo = offs[0].get<uint64_t>(), hi = offs[1].get<uint64_t>();
    const uint64_t want = static_cast<uint64_t>(product(shape)) * dtype_size(dt);
    MOEFLOW_CHECK(lo <= hi && hi <= data_size && hi - lo == want, where, ": data_offsets [", lo, ",", hi,
                  "] do not hold ", want, " bytes within the ", data_size, "-byte buffer");
    file.tensors_[key] = TensorView(const_cast<uint8_t*>(b.data() + data_begin + lo), dt, Device::cpu(), shape);
  }
  return file;
}

std::vector<std::string> SafetensorsFile::keys() const {
  std::vector<std::string> k;
  for (const auto& [key, v] : tensors_) k.push_back(key);
  return k;
}

TensorView SafetensorsFile::view(const std::string& key) const {
  auto it = tensors_.find(key);
  MOEFLOW_CHECK(it != tensors_.end(), name_, ": no tensor '", key, "'");
  return it->second;
}

std::vector<uint8_t> serialize_safetensors(const std::vector<std::pair<std::string, TensorView>>& tensors,
                                           const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [key, v] : tensors) {
    MOEFLOW_CHECK(seen.insert(key).second, "write_safetensors: duplicate key '", key, "'");
    MOEFLOW_CHECK(key != "__metadata__", "write_safetensors: '__metadata__' is reserved");
    MOEFLOW_CHECK(v.defined() && v.device.is_cpu() && v.is_contiguous(), "write_safetensors: '", key,
                  "' must be a contiguous CPU tensor, got ", v.str());
    header[key] = {{"dtype", st_name(v.dtype)}, {"shape", v.sizes()}, {"data_offsets", {offset, offset + v.nbytes()}}};
    offset += v.nbytes();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');  // data starts 8-byte aligned
  std::vector<uint8_t> out(8 + text.size() + offset);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* data = out.data() + 8 + text.size();
  for (const auto& [key, v] : tensors) {
    if (v.nbytes()) std::memcpy(data, v.data, v.nbytes());
    data += v.nbytes();
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::vector<uint8_t> bytes = serialize_safetensors(tensors, metadata);
  std::ofstream f(path, std::ios::binary);
  MOEFLOW_CHECK(f.good(), "cannot write '", path, "'");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  MOEFLOW_CHECK(f.good(), "writing '", path, "' failed");
}

// --- expert parameters -------------------------------------------------------

namespace {

std::string key_of(const ExpertParam& p) { return p.prefix + p.stem; }
std::string key_of(const ExpertParam& p, int e) { return p.prefix + p.stem + std::to_string(e); }

void check_param(const ExpertParam& p) {
  MOEFLOW_CHECK(p.num_experts > 0, key_of(p), ": num_experts must be > 0, got ", p.num_experts);
  MOEFLOW_CHECK(!p.shape.empty() && p.shape.size() < static_cast<size_t>(kMaxDims), key_of(p),
                ": per-expert shape must have 1..", kMaxDims - 1, " dims");
  MOEFLOW_CHECK(p.glu_interleave >= 0, key_of(p), ": glu_interleave must be >= 0");
  if (p.glu_interleave > 0)
    MOEFLOW_CHECK(p.shape[0] % (2 * p.glu_interleave) == 0, key_of(p), ": a GLU parameter with ",
                  p.shape[0], " rows (2F) cannot be interleaved in blocks of ", p.glu_interleave,
                  " (F must be a multiple of it)");
}

int64_t row_bytes(const ExpertParam& p) {
  int64_t n = static_cast<int64_t>(dtype_size(p.dtype));
  for (size_t d = 1; d < p.shape.size(); ++d) n *= p.shape[d];
  return n;
}

// Canonical (halves) row of file row i.
int64_t canonical_row(const ExpertParam& p, int64_t i) {
  const int64_t g = p.glu_interleave;
  if (g == 0) return i;
  const int64_t half = p.shape[0] / 2, block = i / (2 * g), w = i % (2 * g);
  return w < g ? block * g + w : half + block * g + (w - g);
}

std::vector<int64_t> with_experts(const ExpertParam& p) {
  std::vector<int64_t> s = {p.num_experts};
  s.insert(s.end(), p.shape.begin(), p.shape.end());
  return s;
}

std::string shape_text(const std::vector<int64_t>& s) { return detail::shape_str(s); }

// Expert e's bytes in the canonical layout of a destination (stacked or parts).
uint8_t* expert_bytes(const std::vector<TensorView>& parts, const ExpertParam& p, int e) {
  const int64_t expert_size = product(p.shape) * static_cast<int64_t>(dtype_size(p.dtype));
  if (parts.size() == 1 && parts[0].ndim == static_cast<int>(p.shape.size()) + 1)
    return static_cast<uint8_t*>(parts[0].data) + e * expert_size;
  return static_cast<uint8_t*>(parts[e].data);
}

void check_storage(const ExpertParam& p, const std::vector<TensorView>& parts, const char* what) {
  const bool stacked = parts.size() == 1 && parts[0].ndim == static_cast<int>(p.shape.size()) + 1;
  if (stacked) {
    detail::expect(parts[0], what, detail::Expect{{p.dtype}, with_experts(p), Device::cpu()});
    return;
  }
  MOEFLOW_CHECK(static_cast<int>(parts.size()) == p.num_experts, key_of(p), ": ", what, " must be one [E,...] tensor or ",
                p.num_experts, " per-expert tensors, got ", parts.size());
  for (int e = 0; e < p.num_experts; ++e)
    detail::expect(parts[e], what, detail::Expect{{p.dtype}, p.shape, Device::cpu()});
}

}  // namespace

ExpertKeyLayout find_expert_layout(const SafetensorsFile& file, const ExpertParam& p) {
  check_param(p);
  const std::string stem = key_of(p);
  const bool grouped = file.contains(stem);
  std::set<int64_t> indices;
  for (const std::string& k : file.keys()) {
    if (k.size() <= stem.size() || k.compare(0, stem.size(), stem) != 0) continue;
    const std::string tail = k.substr(stem.size());
    if (!std::all_of(tail.begin(), tail.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    indices.insert(std::stoll(tail));
  }
  MOEFLOW_CHECK(!(grouped && !indices.empty()), "checkpoint is ambiguous: it has both '", stem,
                "' and per-expert keys '", stem, "<i>'");
  if (grouped) return ExpertKeyLayout::kGrouped;
  MOEFLOW_CHECK(!indices.empty(), "checkpoint has neither '", stem, "' [E,...] nor '", stem, "0'..'", stem,
                p.num_experts - 1, "'");
  MOEFLOW_CHECK(*indices.rbegin() < p.num_experts, "checkpoint has '", stem, *indices.rbegin(),
                "' but num_experts is ", p.num_experts);
  if (static_cast<int>(indices.size()) != p.num_experts) {
    std::string missing;
    int shown = 0;
    for (int e = 0; e < p.num_experts && shown < 8; ++e)
      if (!indices.count(e)) missing += (shown++ ? ", " : "") + key_of(p, e);
    MOEFLOW_CHECK(false, "checkpoint is incomplete: ", p.num_experts - static_cast<int>(indices.size()),
                  " of ", p.num_experts, " per-expert keys missing (", missing, ")");
  }
  return ExpertKeyLayout::kPerExpert;
}

void load_expert_param(const SafetensorsFile& file, const ExpertParam& p, TensorView dst) {
  load_expert_param(file, p, std::vector<TensorView>{dst});
}

void load_expert_param(const SafetensorsFile& file, const ExpertParam& p, const std::vector<TensorView>& dst) {
  const ExpertKeyLayout layout = find_expert_layout(file, p);
  check_storage(p, dst, "dst");
  const int64_t rb = row_bytes(p), rows = p.shape[0];
  const int64_t expert_size = rows * rb;
  TensorView grouped;
  if (layout == ExpertKeyLayout::kGrouped) {
    grouped = file.view(key_of(p));
    MOEFLOW_CHECK(grouped.dtype == p.dtype && grouped.sizes() == with_experts(p), "checkpoint key '", key_of(p),
                  "' must be ", dtype_name(p.dtype), " ", shape_text(with_experts(p)), ", got ", grouped.str());
  }
  for (int e = 0; e < p.num_experts; ++e) {
    const uint8_t* src;
    if (layout == ExpertKeyLayout::kGrouped) {
      src = static_cast<const uint8_t*>(grouped.data) + e * expert_size;
    } else {
      const TensorView v = file.view(key_of(p, e));
      MOEFLOW_CHECK(v.dtype == p.dtype && v.sizes() == p.shape, "checkpoint key '", key_of(p, e), "' must be ",
                    dtype_name(p.dtype), " ", shape_text(p.shape), ", got ", v.str());
      src = static_cast<const uint8_t*>(v.data);
    }
    uint8_t* out = expert_bytes(dst, p, e);
    for (int64_t i = 0; i < rows; ++i) std::memcpy(out + canonical_row(p, i) * rb, src + i * rb, rb);
  }
}

std::vector<std::pair<std::string, Tensor>> export_expert_param(const ExpertParam& p, TensorView src,
                                                                ExpertKeyLayout layout) {
  return export_expert_param(p, std::vector<TensorView>{src}, layout);
}

std::vector<std::pair<std::string, Tensor>> export_expert_param(const ExpertParam& p,
                                                                const std::vector<TensorView>& src,
                                                                ExpertKeyLayout layout) {
  check_param(p);
  check_storage(p, src, "src");
  const int64_t rb = row_bytes(p), rows = p.shape[0], expert_size = rows * rb;
  std::vector<std::pair<std::string, Tensor>> out;
  Tensor grouped;
  if (layout == ExpertKeyLayout::kGrouped) grouped = Tensor::empty(with_experts(p), p.dtype);
  for (int e = 0; e < p.num_experts; ++e) {
    Tensor part;
    uint8_t* dst;
    if (layout == ExpertKeyLayout::kGrouped) {
      dst = static_cast<uint8_t*>(grouped.data()) + e * expert_size;
    } else {
      part = Tensor::empty(p.shape, p.dtype);
      dst = static_cast<uint8_t*>(part.data());
    }
    const uint8_t* in = expert_bytes(src, p, e);
    for (int64_t i = 0; i < rows; ++i) std::memcpy(dst + i * rb, in + canonical_row(p, i) * rb, rb);
    if (layout == ExpertKeyLayout::kPerExpert) out.emplace_back(key_of(p, e), part);
  }
  if (layout == ExpertKeyLayout::kGrouped) out.emplace_back(key_of(p), grouped);
  return out;
}

}  // namespace moeflow
