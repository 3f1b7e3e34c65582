"""MoELayer's checkpoints: Megatron-Core's two expert key layouts (grouped
or per-expert keys), the GLU row orders, and safetensors files through
moeflow's C++ code (moeflow._C). A mixin of :class:`moeflow.MoELayer`; its
docstring describes the behaviour."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from . import _C

_GATED = ("swiglu", "geglu", "clamped_quick_geglu")
_LAYOUTS = ("grouped", "per_expert")
_EXPERT_PARAMS = ("fc1_weight", "fc2_weight")
_GLU_METADATA_KEY = "moeflow.glu_interleave"  # safetensors metadata: the FC1 row order


# megatron-core's MoELayer keys (0.19: TopKRouter, TEGroupedMLP or
# SequentialMLP experts, SharedExpertMLP) -> MoELayer's
_MEGATRON_KEYS = (
    (re.compile(r"router\.weight"), "router_weight"),
    (re.compile(r"router\.expert_bias"), "expert_bias"),
    (re.compile(r"experts\.linear_fc([12])\.weight([0-9]+)"), r"fc\1_weight\2"),
    (re.compile(r"experts\.local_experts\.([0-9]+)\.linear_fc([12])\.weight"), r"fc\2_weight\1"),
)
# training state of router features MoELayer does not have (global aux loss,
# quantile balancing) and TransformerEngine's per-module state: dropped
_MEGATRON_DROPPED = re.compile(r"(router\.(global_tokens_per_expert|ga_steps|qb_\w+)"
                               r"|.*_extra_state)")


def megatron_state_dict(state_dict: Dict[str, torch.Tensor],
                        prefix: str = "") -> Dict[str, torch.Tensor]:
    """A megatron-core MoELayer's state dict with MoELayer's keys: the keys
    under ``prefix`` (e.g. "decoder.layers.3.mlp."), without it;
    ``router.weight`` -> ``router_weight``, ``router.expert_bias`` ->
    ``expert_bias``, ``experts.linear_fc1.weight<i>`` (TEGroupedMLP) or
    ``experts.local_experts.<i>.linear_fc1.weight`` (SequentialMLP) ->
    ``fc1_weight<i>`` (likewise fc2; the per-expert layout, GLU rows as
    halves as Megatron keeps them), ``shared_experts.*`` as they are.
    TransformerEngine's ``_extra_state`` and the router's global-aux-loss and
    quantile-balancing buffers are dropped; any other key is kept, so that
    ``load_state_dict(strict=True)`` reports it."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix):]
        if _MEGATRON_DROPPED.fullmatch(key):
            continue
        for pattern, repl in _MEGATRON_KEYS:
            if pattern.fullmatch(key):
                key = pattern.sub(repl, key)
                break
        out[key] = value
    return out


def _glu_file_rows(n_rows: int, g: int) -> torch.Tensor:
    """idx [n_rows]: row i of a GLU weight in row order g is row idx[i] of the
    halves order ([gate; up]); as canonical_row in src/core/checkpoint.cpp."""
    i = torch.arange(n_rows)
    if not g:
        return i
    half, block, w = n_rows // 2, i // (2 * g), i % (2 * g)
    return torch.where(w < g, block * g + w, half + block * g + (w - g))


def _reorder_glu(w: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """The FC1 weight w [E, 2F, H] with its rows from order src to order dst
    (a row gather: bitwise)."""
    if src == dst:
        return w
    n = w.shape[1]
    perm = torch.argsort(_glu_file_rows(n, src))[_glu_file_rows(n, dst)]
    return w.index_select(1, perm.to(w.device))


class ExpertCheckpointMixin:
    """state_dict / load_state_dict in both expert key layouts, and
    save_safetensors / load_safetensors (see MoELayer). A layer that holds
    only some experts (expert parallelism) has ``expert_range`` = [first,
    last) of the ``num_experts`` global ones: per-expert keys use the global
    ids, and a whole checkpoint loads its slice."""

    def load_megatron_state_dict(self, state_dict: Dict[str, torch.Tensor], prefix: str = "",
                                 strict: bool = True):
        """Loads a megatron-core MoELayer's state dict (the keys under
        ``prefix``), its keys renamed by :func:`megatron_state_dict`.
        Returns load_state_dict's result."""
        return self.load_state_dict(megatron_state_dict(state_dict, prefix), strict=strict)

    def _local_range(self) -> Tuple[int, int]:
        return tuple(getattr(self, "expert_range", (0, self.num_experts)))

    def _check_glu(self, g: Optional[int], what: str) -> int:
        """The FC1 row order g (None: the layer's own), validated."""
        if g is None:
            return self.glu_interleave
        g = int(g)
        if g and (self.activation not in _GATED or g < 0 or self.ffn_hidden_size % g):
            raise ValueError(f"{what}={g} needs a gated activation and ffn_hidden_size "
                             f"({self.ffn_hidden_size}) a multiple of it")
        return g

    def _check_layout(self, layout: str) -> str:
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        return layout

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        layout = self._check_layout(self.state_dict_layout)
        g = self._check_glu(self.state_dict_glu_interleave, "state_dict_glu_interleave")
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and self.activation in _GATED:
            metadata.setdefault(prefix[:-1], {})["glu_interleave"] = g
        if layout == "grouped" and g == self.glu_interleave:
            return
        # Re-insert this module's entries in order, converted.
        names = [n for n in ("router_weight", "fc1_weight", "fc2_weight", "expert_bias")
                 if prefix + n in destination]
        entries = [(n, destination.pop(prefix + n)) for n in names]
        for name, value in entries:
            if name == "fc1_weight":
                value = _reorder_glu(value, self.glu_interleave, g)
            if layout == "per_expert" and name in _EXPERT_PARAMS:
                first = self._local_range()[0]
                for i in range(value.shape[0]):
                    destination[f"{prefix}{name}{first + i}"] = value[i]
            else:
                destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        src_g = local_metadata.get("glu_interleave", self.state_dict_glu_interleave)
        try:
            src_g = self._check_glu(src_g, "the state dict's glu_interleave")
        except ValueError as e:
            error_msgs.append(str(e))
            src_g = self.glu_interleave
        drop, converted, per_expert = set(), {}, set()
        first, last = self._local_range()
        for name in _EXPERT_PARAMS:
            param = getattr(self, name)
            key = prefix + name
            pattern = re.compile(re.escape(key) + r"([0-9]+)")
            per = {}
            for k in state_dict:
                m = pattern.fullmatch(k)
                if m:
                    per.setdefault(int(m.group(1)), []).append(k)
            if not per:
                w = state_dict.get(key)
                if (w is not None and last - first < self.num_experts and w.dim() >= 1
                        and tuple(w.shape) == (self.num_experts, *param.shape[1:])):
                    w = w[first:last]  # a whole checkpoint: this layer's experts
                if (name == "fc1_weight" and src_g != self.glu_interleave and w is not None
                        and w.shape == param.shape):
                    w = _reorder_glu(w, src_g, self.glu_interleave)
                if w is not None and w is not state_dict[key]:
                    converted[key] = w
                continue  # grouped (or absent: the base class reports it)
            drop.update(k for ks in per.values() for k in ks)
            per_expert.add(key)
            if key in state_dict:
                error_msgs.append(f'the state dict has both "{key}" and per-expert keys '
                                  f'"{key}<i>": it is ambiguous')
                drop.add(key)
                continue
            extra = [k for i in sorted(per) if i >= self.num_experts for k in per[i]]
            extra += [k for i in sorted(per) if len(per[i]) > 1 for k in per[i]]
            if extra:
                error_msgs.append(f"unexpected per-expert key(s) "
                                  f"{', '.join(repr(k) for k in extra)}: the layer has "
                                  f"num_experts={self.num_experts} ({key}0..{key}"
                                  f"{self.num_experts - 1})")
                continue
            # Experts outside [first, last) belong to other ranks: not used here.
            missing = [f"{key}{e}" for e in range(first, last) if e not in per]
            if missing:
                missing_keys.extend(missing)
                continue
            parts = [state_dict[per[e][0]] for e in range(first, last)]
            bad = False
            for e, t in zip(range(first, last), parts):
                if tuple(t.shape) != tuple(param.shape[1:]):
                    error_msgs.append(f"size mismatch for {per[e][0]}: copying a param with shape "
                                      f"{tuple(t.shape)} from checkpoint, the shape in current "
                                      f"model is {tuple(param.shape[1:])}.")
                    bad = True
            if bad:
                continue
            w = torch.stack(parts)
            if name == "fc1_weight":
                w = _reorder_glu(w, src_g, self.glu_interleave)
            converted[key] = w
        if drop or converted:
            state_dict = {k: v for k, v in state_dict.items() if k not in drop}
            state_dict.update(converted)
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A per-expert set not loaded is reported by its own keys, not as the grouped key.
        missing_keys[n_missing:] = [k for k in missing_keys[n_missing:] if k not in per_expert]

    def _expert_params(self, g: int, prefix: str) -> List[Tuple[str, "_C.ExpertParam"]]:
        out = []
        for name in _EXPERT_PARAMS:
            w = getattr(self, name)
            out.append((name, _C.ExpertParam(
                prefix=prefix + name[:-len("weight")], stem="weight", num_experts=self.num_experts,
                shape=list(w.shape[1:]), dtype=str(w.dtype),
                glu_interleave=g if name == "fc1_weight" else 0)))
        return out

    def save_safetensors(self, path: str, layout: str = "grouped",
                         glu_interleave: Optional[int] = None, prefix: str = "",
                         metadata: Optional[Dict[str, str]] = None) -> None:
        """Writes the layer's parameters (and ``expert_bias``) as a
        safetensors file through ``moeflow._C``: keys as ``state_dict`` in
        ``layout`` ("grouped" or "per_expert"), each preceded by ``prefix``;
        FC1 GLU rows in the order ``glu_interleave`` (None: the layer's own),
        recorded in the file's metadata (``"moeflow.glu_interleave"``)."""
        layout = self._check_layout(layout)
        g = self._check_glu(glu_interleave, "glu_interleave")
        if self._local_range() != (0, self.num_experts):
            raise _C.Error(f"save_safetensors: the layer holds experts {self._local_range()} "
                           f"of {self.num_experts} (ep_group); writing a file of all experts "
                           f"needs the other ranks' weights: use state_dict() per rank")
        kind = getattr(_C.ExpertKeyLayout, layout)
        meta = {"format": "pt"}
        if self.activation in _GATED:
            meta[_GLU_METADATA_KEY] = str(g)
        meta.update(metadata or {})
        with torch.no_grad():
            entries = [(prefix + "router_weight", self.router_weight.detach().cpu().contiguous())]
            for name, p in self._expert_params(g, prefix):
                w = getattr(self, name).detach()
                if name == "fc1_weight":  # the C++ code takes the halves order
                    w = _reorder_glu(w, self.glu_interleave, 0)
                entries += _C.export_expert_param(p, w.cpu().contiguous(), kind)
            if self.expert_bias is not None:
                bias = self.expert_bias.detach().cpu().contiguous()
                entries.append((prefix + "expert_bias", bias))
            for name, t in self._shared_tensors():
                entries.append((prefix + name, t.detach().cpu().contiguous()))
            _C.write_safetensors(str(path), entries, meta)

    def load_safetensors(self, path: str, glu_interleave: Optional[int] = None,
                         prefix: str = "", strict: bool = True) -> None:
        """Loads a file written by ``save_safetensors`` (or by the C++
        ``write_safetensors`` / ``export_expert_param``) in either key layout.
        FC1 GLU rows in the order ``glu_interleave``, else the file's
        ``"moeflow.glu_interleave"`` metadata, else ``state_dict_glu_interleave``,
        else the layer's own. dtypes and shapes must match exactly. With
        ``strict``, keys under ``prefix`` that the layer does not use are an
        error. Nothing is changed unless every tensor loads."""
        f = _C.SafetensorsFile.read(str(path))
        if glu_interleave is None and _GLU_METADATA_KEY in f.metadata:
            glu_interleave = int(f.metadata[_GLU_METADATA_KEY])
        if glu_interleave is None:
            glu_interleave = self.state_dict_glu_interleave
        g = self._check_glu(glu_interleave, "glu_interleave")
        used, loaded = set(), {}

        def plain(name: str, t: torch.Tensor) -> None:
            key = prefix + name
            if key not in f:
                raise _C.Error(f"{path}: checkpoint has no tensor '{key}'")
            src = torch.from_dlpack(f.view(key))
            if src.dtype != t.dtype or src.shape != t.shape:
                raise _C.Error(f"{path}: checkpoint key '{key}' must be {str(t.dtype)[6:]} "
                               f"{list(t.shape)}, got {str(src.dtype)[6:]} {list(src.shape)}")
            used.add(key)
            loaded[name] = src.clone()

        plain("router_weight", self.router_weight)
        if self.expert_bias is not None:
            plain("expert_bias", self.expert_bias)
        for name, t in self._shared_tensors():
            plain(name, t)
        first, last = self._local_range()
        for name, p in self._expert_params(g, prefix):
            w = getattr(self, name)
            dst = torch.empty((self.num_experts, *w.shape[1:]), dtype=w.dtype)
            _C.load_expert_param(f, p, dst)  # halves order, all experts
            dst = dst[first:last]
            stem = re.escape(p.prefix + p.stem)
            used.update(k for k in f.keys() if re.fullmatch(stem + r"[0-9]*", k))
            if name == "fc1_weight":
                dst = _reorder_glu(dst, 0, self.glu_interleave)
            loaded[name] = dst
        if strict:
            unused = [k for k in f.keys() if k.startswith(prefix) and k not in used]
            if unused:
                raise _C.Error(f"{path}: unexpected key(s) {', '.join(repr(k) for k in unused)}")
        with torch.no_grad():
            for name, t in loaded.items():
                target = self.get_buffer(name) if name == "expert_bias" else \
                    self.get_parameter(name)
                target.copy_(t)

    def _shared_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """The shared expert's parameters by their state-dict names."""
        if self.shared_experts is None:
            return []
        return [("shared_experts." + n, p) for n, p in self.shared_experts.named_parameters()]
