"""CUDA-graph decoding for fast-weight LMs: `LM.step` captured once, replayed for every token.

At batch 1 a decoding step of the plain-PyTorch layers is a few hundred small kernels with far
less GPU work than host time spent launching them (BENCHMARKS.md, decoding): the host is the
bottleneck, not the GPU. A CUDA graph records the step's kernels once
and replays them with one launch. A graph needs fixed shapes and fixed addresses, which a
fast-weight LM has: its state (memories, conv tails) does not grow. So the step is captured
reading its token and state from static buffers; after each replay, the new state is copied
back into those buffers (one fused copy) and the next token is written in.

Refused, with a GraphError naming the layer: a KV cache (softmax-side layers: the cache grows
every step) and a step that depends on the position (RoPE, e.g. RetNet and TTT presets): the
position is a Python int, fixed at capture. Exact: a replay runs the same kernels on the same
inputs as `LM.step` (scripts/gpu_decode_check.py compares the two on a GPU).

    decoder = GraphedDecoder(model, state, token_ids)   # captures (after `warmup` eager steps)
    logits, state = decoder.step(token_ids, state)      # [B, vocab], the state after the token
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..state import state_map, state_tensors
from .lm import LM, GenerationError, LMState

Tensor = torch.Tensor

__all__ = ["GraphedDecoder", "GraphError", "graph_blockers"]


class GraphError(GenerationError):
    """The model or state cannot be decoded through a CUDA graph; the message says why."""


def graph_blockers(model: LM) -> list[str]:
    """Why `model` cannot decode through a CUDA graph (empty: it can)."""
    why = []
    for i, block in enumerate(model.blocks):
        mixer = block.mixer
        name = mixer.recipe.name
        if mixer.is_softmax:
            why.append(f"layer {i} ({name}) keeps a KV cache, which grows every step")
        elif mixer.preset.rope:
            why.append(f"layer {i} ({name}) applies RoPE, whose position is fixed when the step is captured")
    return why


_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the warm-up steps, reused by every decoder: cuBLAS keeps a
    workspace per stream it has run on (32 MiB on an H100), so a fresh stream per decoder would
    leave one behind each time (measured: +32 MiB allocated per decoder, freed decoder or not)."""
    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WARMUP_STREAMS[device]


class GraphedDecoder:
    """`model.step` for one batch size, dtype and device, replayed from a CUDA graph.

    Args:
        model: an LM in eval mode on a CUDA device whose layers all keep fixed-size states
            (`graph_blockers` lists what stands in the way).
        state: an LMState of that model (e.g. from `model.prefill`): fixes the batch size and the
            state's shapes and dtypes; its values are copied in, it is not modified.
        token_ids: [B] or [B, 1] integer token ids of the batch (values irrelevant at capture).
        warmup: eager steps run on a side stream before capturing (allocator and library set-up).

    `step(token_ids, state)` returns (logits [B, vocab], the state after the token). The returned
    state lives in the decoder's buffers: the next `step` overwrites it (clone it with
    `fastweights.state.state_map(state, torch.clone)` to keep it). Passing it back is free;
    another state of the same shapes is copied in first.
    """

    def __init__(self, model: LM, state: LMState, token_ids: Tensor, *, warmup: int = 2):
        if not isinstance(model, LM):
            raise GraphError(f"model must be a fastweights LM, got {type(model).__name__}")
        if not isinstance(state, LMState) or len(state.layers) != len(model.blocks):
            raise GraphError(f"state must be the LMState of this model ({len(model.blocks)} layers)")
        blockers = graph_blockers(model)
        if blockers:
            raise GraphError("cannot decode through a CUDA graph: " + "; ".join(blockers))
        tensors = state_tensors(state)
        if not tensors or not all(t.is_cuda for t in tensors):
            raise GraphError("CUDA-graph decoding needs the model and its state on a CUDA device")
        if not isinstance(token_ids, Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            raise GraphError(f"token_ids must be an integer tensor [B] or [B, 1], got {type(token_ids).__name__}")
        self.model = model
        self.positions = [st.position for st in state.layers]
        self._tok = token_ids.reshape(-1, 1).to(device=tensors[0].device).clone()  # [B, 1], static
        self._in = state_map(state, lambda t: t.clone())  # static input state
        with torch.no_grad():
            side = _warmup_stream(tensors[0].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    model.step(self._tok, self._in)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._logits, out = model.step(self._tok, self._in)  # [B, vocab], state in the graph's pool
        self._in_flat, self._out_flat = state_tensors(self._in), state_tensors(out)
        self._last: LMState | None = None

    @property
    def batch_size(self) -> int:
        return self._tok.shape[0]

    def step(self, token_ids: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """One token for every sequence: token_ids [B] or [B, 1] -> (logits [B, vocab], state)."""
        if not isinstance(token_ids, Tensor) or token_ids.numel() != self.batch_size:
            raise GraphError(f"token_ids must hold one token per sequence ({self.batch_size}), got "
                             f"{list(getattr(token_ids, 'shape', []))}")
        if state is not self._last:  # a state the decoder did not return: copy it into the buffers
            given = state_tensors(state) if isinstance(state, LMState) else []
            if len(given) != len(self._in_flat) or any(a.shape != b.shape for a, b in zip(given, self._in_flat)):
                raise GraphError("state does not match the one the decoder was captured with (shapes)")
            torch._foreach_copy_(self._in_flat, given)
            self.positions = [st.position for st in state.layers]
        self._tok.copy_(token_ids.reshape(-1, 1))
        self.graph.replay()
        torch._foreach_copy_(self._in_flat, self._out_flat)  # the new state becomes the next step's input
        self.positions = [p + 1 for p in self.positions]
        layers = tuple(replace(st, position=p) for st, p in zip(self._in.layers, self.positions))
        self._last = LMState(layers=layers)
        return self._logits.clone(), self._last

