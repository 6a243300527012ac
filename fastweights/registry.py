"""Every row of the dispatch table, registered in one place: every implementation choice the library
can make, read top to bottom.

This module sits above both backends: it imports the mechanism (`fastweights.dispatch`), the
plain-PyTorch implementations (`torch_backend` for the memory forms, `torch_layer_ops` for the
layer ops) and the Triton rows (`kernels.rows`: functions and capability predicates, no kernel
imported), and registers them. `fastweights.api` imports it, so `import fastweights` fills the table.

    class         form        backends         (the Triton rows' predicates: kernels.rows)
    gated_linear  recurrent   torch, triton    (the fused step kernel: decoding)
    gated_linear  parallel    torch
    gated_linear  chunk       torch, compile, triton
    delta         recurrent   torch, triton    (one plain delta step per token)
    delta         parallel    torch
    delta         chunk       torch, compile, triton
    generic       recurrent   torch
    generic       chunk       torch, triton    (mini-batch memories only; triton: Muon's Newton–Schulz, ATLAS,
                                               and TTT-Linear's whole inner loop)
    mesa          recurrent, parallel, chunk   torch
    mesa          chunk       triton           (the torch chunk form with both CG solves in one kernel each)
    softmax       recurrent, parallel          torch
    layer         conv        torch, triton    (the short convolution)
    layer         norm        torch, triton    (the gated RMSNorm; RMSNorm: no gate, one group)
    layer         prologue    torch, triton    (the delta layer's L2 norm, β and Mamba/KDA gate)
"""

from __future__ import annotations

from . import torch_backend as tb
from . import torch_layer_ops as tops
from .dispatch import LAYER, register
from .kernels import rows as kr

__all__: list[str] = []


def _register() -> None:
    # the memory forms, plain PyTorch (the reference of every other row)
    register("gated_linear", "recurrent", "torch", tb.memory_recurrent_impl)
    register("delta", "recurrent", "torch", tb.memory_recurrent_impl)
    register("generic", "recurrent", "torch", tb.memory_recurrent_impl)
    register("gated_linear", "parallel", "torch", tb.linear_parallel_impl)
    register("delta", "parallel", "torch", tb.linear_parallel_impl)
    register("mesa", "recurrent", "torch", tb.mesa_recurrent_impl)
    register("mesa", "parallel", "torch", tb.mesa_parallel_impl)
    register("softmax", "recurrent", "torch", tb.softmax_recurrent_impl)
    register("softmax", "parallel", "torch", tb.softmax_parallel_impl)
    register("gated_linear", "chunk", "torch", tb.linear_chunk_impl)
    register("delta", "chunk", "torch", tb.linear_chunk_impl)
    register("mesa", "chunk", "torch", tb.mesa_chunk_impl)
    register("generic", "chunk", "torch", tb.minibatch_chunk_impl, supports=tb.generic_chunk_exists)
    # the same chunk code through torch.compile (never picked by "auto": it needs a compile step)
    register("gated_linear", "chunk", "compile", tb.linear_chunk_compiled_impl)
    register("delta", "chunk", "compile", tb.linear_chunk_compiled_impl)
    # the Triton kernels (CUDA)
    register("gated_linear", "chunk", "triton", kr.gated_linear_chunk, supports=kr.triton_chunk_supports,
             pipelines=kr.GATED_PIPELINES, pipeline=kr.gated_chunk_pipeline, variants=kr.gated_chunk_variants,
             alternatives=kr.gated_chunk_alternatives)
    register("delta", "chunk", "triton", kr.delta_chunk, supports=kr.triton_chunk_supports,
             pipelines=kr.DELTA_PIPELINES, pipeline=kr.delta_chunk_pipeline, variants=kr.delta_chunk_variants,
             alternatives=kr.delta_chunk_alternatives)
    register("generic", "chunk", "triton", kr.generic_chunk, supports=kr.triton_generic_supports,
             pipelines=kr.GENERIC_PIPELINES, pipeline=kr.generic_chunk_pipeline, variants=kr.generic_chunk_variants,
             alternatives=kr.generic_chunk_alternatives)
    # the CG kernel: timed on an H100 (BENCHMARKS §1l), its cuda tests passed on an H200 (§1m); "auto" takes it
    register("mesa", "chunk", "triton", kr.mesa_chunk, supports=kr.triton_mesa_supports,
             pipelines=kr.MESA_PIPELINES, pipeline=kr.mesa_chunk_pipeline)
    register("gated_linear", "recurrent", "triton", kr.linear_recurrent, supports=kr.triton_step_supports)
    register("delta", "recurrent", "triton", kr.linear_recurrent, supports=kr.triton_step_supports)
    # the layer ops around the memory read
    register(LAYER, "conv", "torch", tops.short_conv)
    register(LAYER, "norm", "torch", tops.gated_rms_norm)
    register(LAYER, "prologue", "torch", tops.delta_prologue)
    register(LAYER, "conv", "triton", kr.short_conv, supports=kr.triton_conv_supports, variants=kr.short_conv_variants,
             alternatives=kr.short_conv_alternatives)
    register(LAYER, "norm", "triton", kr.gated_rms_norm, supports=kr.triton_norm_supports)
    register(LAYER, "prologue", "triton", kr.delta_prologue, supports=kr.triton_prologue_supports)
    register(LAYER, "rope", "torch", tops.rope)
    register(LAYER, "rope", "triton", kr.rope, supports=kr.triton_rope_supports)


_register()
