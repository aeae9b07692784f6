"""SGD and Adam that train 16-bit weights without any FP32 copy (the report's sections 3.2 and 4.3).

A step is a handful of multi-tensor operations, whatever the number of parameter tensors: the
parameters of a group are split by device and dtype, and

- 16-bit tensors (FP16/BF16 weights, gradients and state) go to one fused update
  (``lowmem.kernels``): every element computed in FP32 in registers and written back in 16 bits,
  with no FP32 temporaries (the plain-torch fallback works through 16K-element slices);
- FP32 and FP64 tensors go through ``torch._foreach_*`` operations in place, the same arithmetic as
  ``torch.optim.SGD`` (bit for bit) and fairseq's Adam. The update is computed inside the gradient
  tensors, so **a step consumes the gradients** (they hold the update afterwards) and needs no
  memory beyond them.

Gradients may arrive scaled by a loss scaler: ``step(grad_scale=scaler.scale)`` divides by the scale
in FP32, so no unscaled FP16 gradient (which could underflow) is ever materialised. Nothing in a
step waits for the device (no host synchronisation).

State is created with the optimizer (zeros), so the memory of the first step is that of every
step. Layout, and what the sparsity technique may do with it: every state tensor shaped like its
parameter (SGD's ``momentum_buffer``; Adam's ``exp_avg`` and ``exp_avg_sq``) may be zeroed at any
positions or replaced by another of the parameter's new shape between steps, because a stored zero
is a zero moment whatever the tensor's scale. The 0-dim FP32 ``*_log2_scale`` tensors and ``step``
must be left alone. Stochastic rounding draws counter-based random numbers (``lowmem.kernels
.reference``): ``rounding_step`` in the state dict is all a resumed run needs to round as the
original.

**8- and 4-bit state** (``state_bits=8`` or ``4``; ``optim.state_bits``): the momentum buffer and
Adam's moments are held blockwise quantized (``lowmem.kernels.quantized``; the maps and why:
``lowmem.kernels.codebooks``) for FP32, FP16 and BF16 weights alike, as ``<name>_codes`` (uint8)
and ``<name>_scales`` (FP32, one per block of ``block_size`` values) — ``momentum``, ``exp_avg``,
``exp_avg_sq``. Such state is not shaped like its parameter, so the sparsity technique resets and
moves it through ``reset_state`` / ``remap_state``, which re-quantize the blocks they touch.

**Sharded parameters** (``trainer.parallel=fsdp``: FSDP2's ``DTensor``s, each rank holding some rows):
the state is created like the parameter (a sharded ``DTensor`` too, which sharded checkpoints save and
load across numbers of ranks), and a step updates each rank's local pieces of parameters, gradients
and state as plain tensors (``lowmem.techniques.shards.local``): the same per-element arithmetic, so
FP32/FP64 updates equal the unsharded ones bit for bit. Quantized state is held per local piece: its
blocks lie within each rank's rows. Adam's per-tensor FP16 moment scales become per-piece scales.
Resumed on another number of ranks, a piece may be held as several segments, each with its own
blocks or moment scales (``reshard_state``: exact), updated one by one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lowmem import kernels
from lowmem.kernels import quantized
from lowmem.kernels.quantized import QState
from lowmem.kernels.reference import _MASK32, SLICE, _pow2, adam_step_size, fmix32, moment_log2_scale, tensor_keys
from lowmem.techniques.shards import full, gather_like, is_sharded, local, local_rows, moved_entries, write_full

STATE_SEED_SALT = 0x2545F491  # quantized state's rounding keys: tensor_keys(seed ^ this, step, ...)

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_QUANTIZABLE = (torch.float32, *_SIXTEEN_BIT)
# The keys a state dict holds in their own dtype (torch's Optimizer.load_state_dict would cast every
# state tensor to its parameter's dtype).
_QUANTIZED_SUFFIXES = ("_codes", "_scales")
SEGMENTS = "segments"  # state key: the value counts of a local piece's segments (int64; see ``reshard_state``)
_OWN_DTYPE_SUFFIXES = ("_log2_scale", SEGMENTS, *_QUANTIZED_SUFFIXES)


class _LowPrecisionOptimizer(torch.optim.Optimizer):
    """What both optimizers share: state created up front, parameters grouped by device and dtype,
    the stochastic-rounding counter."""

    # The quantized state tensors of each parameter, by name, and whether each is signed.
    _MOMENTS: tuple[tuple[str, bool], ...] = ()

    def __init__(
        self, params: Iterable, defaults: dict[str, Any], stochastic_rounding: bool, seed: int,
        state_bits: int | None = None, block_size: int = 128,
    ) -> None:  # fmt: skip
        if state_bits not in (None, 8, 4):
            raise ValueError(f"state_bits={state_bits!r}: quantized state has 8 or 4 bits (None: the weights' dtype)")
        if block_size < 16 or block_size > 4096 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size!r}: a power of two from 16 to 4096")
        self.state_bits = state_bits  # 8 or 4: quantized state; None: state in the parameter's dtype
        self.block_size = block_size
        super().__init__(params, defaults)
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.rounding_step = 0  # applied steps: the counter of the stochastic-rounding stream
        # Each parameter's index over the whole optimizer: its stochastic-rounding stream.
        self._index = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param, group)
        self._check_kernels()

    def _check_kernels(self) -> None:
        """Have each fused kernel this optimizer will call prove itself now, before any step (its probe
        allocates a little, which a step's measured peak should not see): ``kernels.verified``."""
        kind = "adam" if "betas" in self.defaults else "sgd"
        quantized_state = self.state_bits is not None and (
            kind == "adam" or any(group["momentum"] != 0 for group in self.param_groups)
        )
        for device, dtype in {(p.device, p.dtype) for group in self.param_groups for p in group["params"]}:
            if kernels.backend(device) == "torch":
                continue
            if quantized_state and dtype in _QUANTIZABLE:
                kernels.verified(f"{kind}_q", device, dtype, self.state_bits, self.block_size)
            elif dtype in _SIXTEEN_BIT:
                kernels.verified(kind, device, dtype)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    # --- quantized state -------------------------------------------------------------------------
    def _init_quantized(self, param: torch.Tensor, names: Iterable[tuple[str, bool]]) -> None:
        if param.dtype not in _QUANTIZABLE:
            raise ValueError(
                f"{self.state_bits}-bit optimizer state needs FP32, FP16 or BF16 weights, not {param.dtype}"
            )
        for name, signed in names:
            numel = local(param).numel()  # sharded: the blocks of this rank's rows
            codes, scales = quantized.zeros(numel, self.state_bits, self.block_size, signed, param.device)
            self.state[param][f"{name}_codes"], self.state[param][f"{name}_scales"] = codes, scales

    def _qstate(self, param: torch.Tensor, name: str) -> QState:
        state = self.state[param]
        return QState(state[f"{name}_codes"], state[f"{name}_scales"])

    def _moments_of(self, param: torch.Tensor) -> list[tuple[str, bool]]:
        return [(name, signed) for name, signed in self._MOMENTS if f"{name}_codes" in self.state.get(param, {})]

    def _shaped_like(self, param: torch.Tensor) -> list[str]:
        """The keys of ``param``'s state in its own dtype and shape (not quantized codes that happen to
        have as many bytes as it has values)."""
        return [
            key
            for key, value in self.state.get(param, {}).items()
            if isinstance(value, torch.Tensor)
            and value.shape == param.shape
            and not key.endswith((SEGMENTS, *_QUANTIZED_SUFFIXES))
        ]

    def read_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """Quantized state ``name`` of ``param`` (e.g. "exp_avg") in FP32, shaped like the parameter."""
        signed = dict(self._MOMENTS)[name]
        values = quantized.read(self._qstate(param, name), param.numel(), self.state_bits, self.block_size, signed)
        return values.view(param.shape)

    @torch.no_grad()
    def reset_state(self, param: torch.Tensor, where: torch.Tensor) -> None:
        """Zero the state of ``param`` at the positions ``where`` (bool, shaped like it) is True: the
        slices of blocks holding such a position are read back, zeroed there and quantized anew (a
        zero stays an exact zero); the others are left as they are. State in the parameter's dtype
        is zeroed in place."""
        if is_sharded(param):  # sharded: this rank's rows of ``where``, its own blocks
            self._reset_local_state(param, local_rows(where.to(local(param).device).view(param.shape), param))
            return
        where = where.to(param.device).reshape(-1)
        for key in self._shaped_like(param):
            self.state[param][key].masked_fill_(where.view(param.shape), 0)
        for name, signed in self._moments_of(param):
            state = self._qstate(param, name)
            for start in range(0, param.numel(), SLICE):
                hit = where[start : start + SLICE]
                if not bool(hit.any()):
                    continue
                values = quantized.read_slice(state, start, hit.numel(), self.state_bits, self.block_size, signed)
                quantized.write_slice(state, start, values.masked_fill_(hit, 0), self.state_bits, self.block_size,
                                      signed)

    def _reset_local_state(self, param: torch.Tensor, where: torch.Tensor) -> None:
        """``reset_state`` of a sharded ``param``, ``where`` its rows this rank holds: state in the
        parameter's dtype zeroed in place (an FP16 moment's zero is exact at any scale); quantized
        state read back, zeroed there and quantized anew in this rank's own blocks."""
        for key in self._shaped_like(param):
            local(self.state[param][key]).masked_fill_(where, 0)
        state = self.state[param]
        for name, signed in self._moments_of(param):
            values = self._read_local(param, name, signed).masked_fill_(where.reshape(-1), 0)
            state[f"{name}_codes"], state[f"{name}_scales"] = quantized.quantize(
                values, self.state_bits, self.block_size, signed
            )
        if self._moments_of(param):
            state.pop(SEGMENTS, None)  # quantized anew in this rank's own blocks

    @torch.no_grad()
    def remap_state(self, param: torch.Tensor, kept_from: torch.Tensor, kept_to: torch.Tensor, size: int) -> None:
        """Compact sparsity's rewiring: the state of ``param`` (its old active entries) becomes that of
        ``size`` entries, holding old entry ``kept_from[i]`` at ``kept_to[i]`` and zero elsewhere (the
        regrown). Quantized state is read back, moved, and quantized in the new blocks."""
        state = self.state.get(param, {})
        for key in self._shaped_like(param):
            moved = state[key].new_zeros(size)
            moved[kept_to] = state[key][kept_from]
            state[key] = moved
        for name, signed in self._moments_of(param):
            old = quantized.read(self._qstate(param, name), param.numel(), self.state_bits, self.block_size, signed)
            moved = old.new_zeros(size)
            moved[kept_to] = old[kept_from]
            state[f"{name}_codes"], state[f"{name}_scales"] = quantized.quantize(
                moved, self.state_bits, self.block_size, signed
            )

    @torch.no_grad()
    def remap_shared_state(self, param: torch.Tensor, source: torch.Tensor) -> None:
        """Compact sparsity's rewiring of shared (sharded) values: the state's entry i becomes the old
        entry ``source[i]`` (zero where -1). Sharded state is gathered, moved alike on every rank and
        each rank keeps its rows; quantized state is read back, gathered, moved and quantized anew in
        this rank's blocks."""
        state = self.state.get(param, {})
        for key in self._shaped_like(param):
            if f"{key}_log2_scale" in state and is_sharded(param):  # FP16 moments: per-piece scales
                self._remap_scaled_moment(param, key, source)
            else:
                write_full(state[key], moved_entries(full(state[key]), source))
        for name, signed in self._moments_of(param):
            piece = self._read_local(param, name, signed)
            moved = moved_entries(gather_like(piece, param), source)
            mine = local_rows(moved, param)
            state[f"{name}_codes"], state[f"{name}_scales"] = quantized.quantize(
                mine, self.state_bits, self.block_size, signed
            )
        state.pop(SEGMENTS, None)  # quantized anew in this rank's own blocks

    def _remap_scaled_moment(self, param: torch.Tensor, key: str, source: torch.Tensor) -> None:
        """``remap_shared_state`` for an FP16 moment stored times ``2**{key}_log2_scale``: sharded,
        each rank's piece (each segment) has its own scale, so entries moved across ranks are moved
        as values (FP32), and each rank stores its new piece at the scale its largest value now takes
        (``lowmem.kernels.reference.moment_log2_scale``, as an update would choose)."""
        state = self.state[param]
        stored, scales = local(state[key]), state[f"{key}_log2_scale"].reshape(-1)
        flat = stored.reshape(-1).float()
        values = torch.cat([flat[a:b] * _pow2(-scales[index]) for index, (a, b) in enumerate(self._segments(param))])
        mine = local_rows(moved_entries(gather_like(values.view(stored.shape), param), source), param)
        top = mine.abs().max() if mine.numel() else mine.new_zeros(())
        scale = moment_log2_scale(top.float())
        stored.copy_(mine * _pow2(scale))
        state[f"{key}_log2_scale"] = scale.reshape(()).to(scales.device)  # one segment now: 0-dim, as made

    # --- segments: a local piece in several layouts, after a resume on another number of ranks -----
    def _segments(self, param: torch.Tensor) -> list[tuple[int, int]]:
        """The ``[start, stop)`` values of each segment of ``param``'s local piece (``reshard_state``):
        the whole piece, unless resumed from another number of ranks."""
        sizes = self.state.get(param, {}).get(SEGMENTS)
        if sizes is None:
            return [(0, local(param).numel())]
        stops = torch.cumsum(sizes, 0).tolist()
        return list(zip([0, *stops[:-1]], stops, strict=True))

    def _qsegments(self, param: torch.Tensor, name: str) -> list[QState]:
        """Quantized state ``name`` of ``param``, one ``QState`` (views) per segment."""
        state, pieces, codes_at, scales_at = self._qstate(param, name), [], 0, 0
        for start, stop in self._segments(param):
            codes, scales = quantized.code_bytes(stop - start, self.state_bits), -(-(stop - start) // self.block_size)
            pieces.append(
                QState(state.codes[codes_at : codes_at + codes], state.scales[scales_at : scales_at + scales])
            )
            codes_at, scales_at = codes_at + codes, scales_at + scales
        return pieces

    def _read_local(self, param: torch.Tensor, name: str, signed: bool) -> torch.Tensor:
        """Quantized state ``name`` of this rank's piece of ``param``, in FP32, flat."""
        return torch.cat([
            quantized.read(piece, stop - start, self.state_bits, self.block_size, signed)
            for piece, (start, stop) in zip(self._qsegments(param, name), self._segments(param), strict=True)
        ])

    def _pieces(
        self, params: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, int, slice | None]]]:
        """The weights and gradients of ``params`` as the kernels take them, one tensor per segment
        (this rank's piece itself when it is one), and (parameter, segment index, values or None) of each."""
        owners = []
        for param in params:
            segments = self._segments(param)
            owners += [(param, index, slice(*bounds) if len(segments) > 1 else None) for index, bounds in
                       enumerate(segments)]  # fmt: skip
        weights = [_part(local(p), part) for p, _, part in owners]
        return weights, [_part(local(p.grad), part) for p, _, part in owners], owners

    def _segment_keys(
        self, keys: list[int] | None, params: list[torch.Tensor], owners: list[tuple[torch.Tensor, int, Any]]
    ) -> list[int] | None:
        if keys is None:
            return None
        by_param = {id(p): key for p, key in zip(params, keys, strict=True)}
        return [self._segment_key(by_param[id(p)], index) for p, index, _ in owners]

    @staticmethod
    def _segment_key(key: int, index: int) -> int:
        """A segment's random key: the tensor's for the first, distinct streams for the others."""
        return key if index == 0 else fmix32((key + index * 0x9E3779B9) & _MASK32)

    @torch.no_grad()
    def reshard_state(
        self, param: torch.Tensor, start: int, saved: list[tuple[int, int, dict[str, torch.Tensor]]]
    ) -> None:
        """Set the state this rank keeps for its own piece of ``param`` only (8/4-bit codes and
        scales; FP16 Adam's moment scales), the piece starting at value ``start`` of the flattened
        whole, from the pieces other ranks saved: ``saved`` holds, for each that overlaps it, the
        values ``[begin, end)`` it covered and its state (same keys).

        Exact, with no re-quantization: every value keeps the code and the scale it was saved with.
        A rank's piece may then span several saved pieces, each quantized in blocks of its own that
        a single layout of this piece could not hold (one scale per ``block_size`` values from the
        piece's start: a block joining two saved blocks of different scales would have to round
        their values again). So the piece is held as *segments*, each laid out from its own start
        (``SEGMENTS``: their value counts): every part of a saved segment that lies in this piece,
        split before its first whole block when it starts inside one (a saved block cut in two keeps
        its scale in both parts: a scale need not be the largest magnitude of its block). FP16
        Adam's moments keep their values (they are rows of a sharded tensor, loaded as saved) and
        their per-segment ``2**log2_scale`` likewise. The update runs per segment; a rewiring
        re-quantizes the piece into one."""
        stop = start + local(param).numel()
        state = self.state[param]
        names = [name for name, _ in self._MOMENTS if f"{name}_codes" in state]
        scale_keys = [key for key in state if key.endswith("_log2_scale")]
        block = self.block_size if names else None
        sizes: list[int] = []
        codes: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        scales: dict[str, list[torch.Tensor]] = {key: [] for key in [*names, *scale_keys]}
        for begin, end, entries in saved:
            bounds = entries[SEGMENTS].tolist() if SEGMENTS in entries else [end - begin]
            unpacked = {name: self._saved_segments(entries, name, bounds) for name in names}
            at = begin
            for index, size in enumerate(bounds):
                for first, last in _cuts(max(at, start) - at, min(at + size, stop) - at, block):
                    sizes.append(last - first)
                    for name, segments in unpacked.items():
                        segment_codes, segment_scales = segments[index]
                        codes[name].append(quantized._pack(segment_codes[first:last], self.state_bits))
                        scales[name].append(segment_scales[first // block : -(-last // block)])
                    for key in scale_keys:
                        scales[key].append(entries[key].reshape(-1)[index])
                at += size
        device = param.device
        for name in names:
            if sizes:
                state[f"{name}_codes"] = torch.cat(codes[name]).to(device)
                state[f"{name}_scales"] = torch.cat(scales[name]).to(device)
            else:
                state[f"{name}_codes"], state[f"{name}_scales"] = quantized.zeros(
                    0, self.state_bits, self.block_size, True, device
                )
        for key in scale_keys:
            if sizes:
                joined = torch.stack(scales[key]) if len(sizes) > 1 else scales[key][0].clone()
                state[key] = joined.to(device)
        if len(sizes) > 1:
            state[SEGMENTS] = torch.tensor(sizes, dtype=torch.int64)
        else:
            state.pop(SEGMENTS, None)

    def _saved_segments(
        self, entries: dict[str, torch.Tensor], name: str, bounds: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Saved quantized state ``name``, per segment of ``bounds`` values: its codes (one int32 per
        value) and its scales."""
        segments, codes_at, scales_at = [], 0, 0
        for size in bounds:
            codes, scales = quantized.code_bytes(size, self.state_bits), -(-size // self.block_size)
            packed = entries[f"{name}_codes"][codes_at : codes_at + codes]
            block_scales = entries[f"{name}_scales"][scales_at : scales_at + scales]
            segments.append((quantized._unpack(packed, size, self.state_bits), block_scales))
            codes_at, scales_at = codes_at + codes, scales_at + scales
        return segments

    def _by_dtype(self, group: dict[str, Any]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
        """The group's parameters that have a gradient (sharded: and rows on this rank), by (device, dtype)."""
        split: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in group["params"]:
            if param.grad is not None and local(param).numel() > 0:
                split.setdefault((param.device, param.dtype), []).append(param)
        return split

    def _keys(self, params: list[torch.Tensor]) -> list[int] | None:
        """Stochastic rounding's per-tensor keys for this step, or None (round to nearest)."""
        if not self.stochastic_rounding:
            return None
        return self._step_keys(params, self.seed)

    def _state_keys(self, params: list[torch.Tensor]) -> list[int]:
        """Quantized state's per-tensor rounding keys for this step (``quantized.py``): the weights'
        stream of another seed, so the state's random bits are not the weights'."""
        return self._step_keys(params, self.seed ^ STATE_SEED_SALT)

    def _step_keys(self, params: list[torch.Tensor], seed: int) -> list[int]:
        keys = tensor_keys(seed, self.rounding_step, len(self._index))
        return [keys[self._index[p]] for p in params]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rounding_step"] = self.rounding_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.rounding_step = int(state_dict.pop("rounding_step", 0))
        state_dict.pop("rounding_generator", None)  # written by lowmem before counter-based rounding
        super().load_state_dict(state_dict)
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype: the per-tensor
        # and per-block scales (FP32) and the codes (uint8) are put back as they were saved.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id, {})
            for key, value in saved.items():
                if key.endswith(_OWN_DTYPE_SUFFIXES) and isinstance(value, torch.Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)


def read_moment(state: dict[str, Any], key: str) -> torch.Tensor:
    """Adam's moment ``key`` ("exp_avg" or "exp_avg_sq") of one parameter, in FP32 and unscaled
    (state in the parameter's dtype; ``optimizer.read_state`` reads quantized state)."""
    stored, scale = state[key], state.get(f"{key}_log2_scale")
    return stored.float() if scale is None else torch.ldexp(stored.float(), -scale)


def _unscale_(grads: list[torch.Tensor], grad_scale: float) -> None:
    if grad_scale != 1.0:
        torch._foreach_div_(grads, grad_scale)


class LowPrecisionSGD(_LowPrecisionOptimizer):
    """SGD with (Nesterov) momentum; the momentum buffer is kept in the parameter's dtype.

    Per element, in FP32: ``g = grad / grad_scale + weight_decay * w``; ``buf = momentum * buf + g``;
    ``w -= lr * (g + momentum * buf)`` (Nesterov) or ``w -= lr * buf``. For FP32 parameters this is
    bit-for-bit ``torch.optim.SGD(..., nesterov=nesterov)``. ``stochastic_rounding`` applies to the
    weight's write-back (the momentum is rounded to nearest).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 5e-4,
        stochastic_rounding: bool = False,
        seed: int = 0,
        state_bits: int | None = None,
        block_size: int = 128,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"SGD needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}"
            )
        if nesterov and momentum == 0:
            raise ValueError("SGD with nesterov=True needs momentum > 0")
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay}
        super().__init__(params, defaults, stochastic_rounding, seed, state_bits, block_size)

    _MOMENTS = (("momentum", True),)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        if group["momentum"] == 0:
            return
        if self.state_bits is not None:
            self._init_quantized(param, self._MOMENTS)
        else:
            self.state[param]["momentum_buffer"] = torch.zeros_like(param)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        self.rounding_step += 1
        for group in self.param_groups:
            lr, momentum, nesterov, decay = group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]
            for (_, dtype), sharded in self._by_dtype(group).items():
                params, grads = [local(p) for p in sharded], [local(p.grad) for p in sharded]
                if self.state_bits is not None and momentum != 0:
                    weights, pieces, owners = self._pieces(sharded)
                    kernels.sgd_quantized(
                        weights, pieces, [self._qsegments(p, "momentum")[index] for p, index, _ in owners],
                        self._segment_keys(self._keys(sharded) if dtype in _SIXTEEN_BIT else None, sharded, owners),
                        self._segment_keys(self._state_keys(sharded), sharded, owners),
                        bits=self.state_bits,
                        block_size=self.block_size, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=decay,
                        grad_scale=grad_scale,
                    )
                    continue
                momenta = [local(self.state[p]["momentum_buffer"]) for p in sharded] if momentum != 0 else []
                if dtype in _SIXTEEN_BIT:
                    kernels.sgd(params, grads, momenta, self._keys(sharded), lr=lr, momentum=momentum,
                                nesterov=nesterov, weight_decay=decay, grad_scale=grad_scale)
                    continue
                # FP32/FP64: torch.optim.SGD's arithmetic, in place in the gradients.
                _unscale_(grads, grad_scale)
                if decay != 0:
                    torch._foreach_add_(grads, params, alpha=decay)
                update = grads
                if momentum != 0:
                    torch._foreach_mul_(momenta, momentum)
                    torch._foreach_add_(momenta, grads)
                    if nesterov:
                        torch._foreach_add_(grads, momenta, alpha=momentum)
                    else:
                        update = momenta
                torch._foreach_add_(params, update, alpha=-lr)


class LowPrecisionAdam(_LowPrecisionOptimizer):
    """fairseq's Adam: bias-corrected moments, decoupled weight decay, moments in the param's dtype.

    Per element, in FP32, at step t: ``g = grad / grad_scale``; ``m = b1 m + (1-b1) g``;
    ``v = b2 v + (1-b2) g^2``; ``w *= 1 - lr * weight_decay``;
    ``w -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)``.

    For 16-bit parameters each moment is stored scaled per tensor by ``2**log2_scale`` (FP32 0-dim
    state, re-chosen every step from the moment's max |value|), because unscaled FP16 moments —
    especially ``v``, a square of small gradients — mostly round to zero and training diverges.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = False,
        seed: int = 0,
        state_bits: int | None = None,
        block_size: int = 128,
    ) -> None:
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"Adam needs lr >= 0, eps > 0, weight_decay >= 0, 0 <= betas < 1; "
                f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, stochastic_rounding, seed, state_bits, block_size)

    # The second moment is never negative: an unsigned map, whose zero is an exact zero's only.
    _MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        state["step"] = 0
        if self.state_bits is not None:
            self._init_quantized(param, self._MOMENTS)
            return
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
        if param.dtype in _SIXTEEN_BIT:
            for key in ("exp_avg_log2_scale", "exp_avg_sq_log2_scale"):
                state[key] = torch.zeros((), dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` is the loss scale (a factor)."""
        self.rounding_step += 1
        for group in self.param_groups:
            (beta1, beta2), lr, eps, weight_decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            decay = 1 - lr * weight_decay if weight_decay != 0 else None
            for (_, dtype), sharded in self._by_dtype(group).items():
                states = [self.state[p] for p in sharded]
                for state in states:
                    state["step"] += 1
                step_sizes = [adam_step_size(lr, beta1, beta2, state["step"]) for state in states]
                params, grads = [local(p) for p in sharded], [local(p.grad) for p in sharded]
                if self.state_bits is not None or dtype in _SIXTEEN_BIT:  # per segment (``reshard_state``)
                    weights, pieces, owners = self._pieces(sharded)
                    size_of = {id(p): size for p, size in zip(sharded, step_sizes, strict=True)}
                    sizes = [size_of[id(p)] for p, _, _ in owners]
                    keys = self._segment_keys(self._keys(sharded) if dtype in _SIXTEEN_BIT else None, sharded, owners)
                if self.state_bits is not None:
                    kernels.adam_quantized(
                        weights, pieces, [self._qsegments(p, "exp_avg")[index] for p, index, _ in owners],
                        [self._qsegments(p, "exp_avg_sq")[index] for p, index, _ in owners], sizes,
                        keys, self._segment_keys(self._state_keys(sharded), sharded, owners),
                        bits=self.state_bits,
                        block_size=self.block_size, beta1=beta1, beta2=beta2, eps=eps, decay=decay,
                        grad_scale=grad_scale,
                    )
                    continue
                if dtype in _SIXTEEN_BIT:
                    moments = [
                        [_part(local(self.state[p][key]), part) for p, _, part in owners]
                        for key in ("exp_avg", "exp_avg_sq")
                    ]
                    scales = [
                        tuple(_part(self.state[p][f"{key}_log2_scale"], None if part is None else index)
                              for key in ("exp_avg", "exp_avg_sq"))
                        for p, index, part in owners
                    ]  # fmt: skip
                    kernels.adam(weights, pieces, *moments, scales, sizes, keys,
                                 beta1=beta1, beta2=beta2, eps=eps, decay=decay, grad_scale=grad_scale)
                    continue
                exp_avgs = [local(s["exp_avg"]) for s in states]
                exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
                # FP32/FP64: in place; the gradients end up holding the denominators.
                _unscale_(grads, grad_scale)
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
                if decay is not None:
                    torch._foreach_mul_(params, decay)
                torch._foreach_copy_(grads, exp_avg_sqs)
                torch._foreach_sqrt_(grads)
                torch._foreach_add_(grads, eps)
                torch._foreach_addcdiv_(params, exp_avgs, grads, [-size for size in step_sizes])


def _part(tensor: torch.Tensor, part: slice | int | None) -> torch.Tensor:
    """``tensor``'s values ``part`` (a view: a slice of the flattened tensor, or one entry), or itself."""
    return tensor if part is None else tensor.reshape(-1)[part]


def _cuts(first: int, last: int, block: int | None) -> list[tuple[int, int]]:
    """``[first, last)`` of a saved segment as segments of their own: cut before its first whole
    block when it starts inside one (``block``: the block size of quantized state, or None)."""
    if first >= last:
        return []
    if block is None or first % block == 0:
        return [(first, last)]
    boundary = min(last, -(-first // block) * block)
    return [(first, boundary)] + ([(boundary, last)] if boundary < last else [])
