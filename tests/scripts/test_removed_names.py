"""No script under scripts/ (.py or .sh) names a kernel-module global or environment variable the pipelines
refactor removed (kernels/pipelines.py, docs/kernels.md "Pipelines"): setting one now does nothing, so a script that
still did would measure the default pipeline under another pipeline's name. REMOVED lists them, module by module; a
later removal adds its names here. (That every script imports, prints its --help and takes only public names that
exist: test_scripts.py beside this file.)
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.helpers import triton_kernel_modules

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SHELL = sorted((ROOT / "scripts").glob("*.sh"))

#: module of fastweights.kernels.triton -> names that no longer mean what they did (the argument that replaced
#: each, docs/kernels.md "Pipelines"). "alias" marks a name still defined (a constant kept under its old name): a
#: script must not read or set it there either — the rule reads `kernels/pipelines.py` and `triton/limits.py`.
REMOVED: dict[str, dict[str, str]] = {
    "delta": {
        "FORWARD": "DeltaPipeline.forward (pipeline= of chunk_delta_triton)",
        "FORWARDS": "pipelines.STAGES",
        "BACKWARD": "DeltaPipeline.backward",
        "BACKWARDS": "pipelines.STAGES",
        "FUSED_CHECKED_HEAD_DIMS_CUDA": "pipelines.FUSED_CHECKED_HEAD_DIMS_CUDA",
        "LOW_PRECISION_MIN_HEAD_DIM_CUDA": "alias: pipelines.LOW_PRECISION_MIN_HEAD_DIM_CUDA",
        "runs_in_fp32": "DeltaPipeline.fp32 (pipelines.delta_pipeline)",
        "RECOMPUTE_STATES": "DeltaPipeline.recompute_states",
        "uses_fused_forward": "pipelines.delta_pipeline",
        "uses_fused_backward": "pipelines.delta_pipeline",
    },
    "delta_fused": {"FUSED_MAX_HEAD_DIM_CUDA": "alias: limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA"},
    "delta_fused_bwd": {"MAX_K": "alias: limits.DELTA_FUSED_BWD_MAX_K", "MAX_C": "alias: limits.DELTA_FUSED_BWD_MAX_C"},
    "gated": {
        "PIPELINE": "GatedPipeline.pipeline (pipeline= of chunk_gated_triton)",
        "PIPELINES": "pipelines.STAGES",
        "uses_fused": "pipelines.gated_pipeline",
    },
    "gated_fused": {
        "supports": "pipelines.gated_fused_serves",
        "GATES": "pipelines.gated_fused_serves (every gate kind)",
        "FUSED_MAX_HEAD_DIM_CUDA": "alias: limits.GATED_FUSED_MAX_HEAD_DIM_CUDA",
        "RECOMPUTE_STATES": "GatedPipeline.recompute_states",
    },
    "conv": {"RECOMPUTE_OUTPUTS": "short_conv(..., recompute_outputs=)",
             "_FWD": 'util.LAUNCH["conv_fwd"]',
             "_BWD": 'util.LAUNCH["conv_bwd_fused"], ["conv_bwd_dpre"], ["conv_bwd_dx"]'},
    "newton_schulz": {"precision": "newton_schulz_gram(..., precision=), rows.generic_chunk(..., precision=)"},
    "ttt": {"TTT_LAUNCH": 'util.LAUNCH["ttt_linear_fwd"], ["ttt_linear_bwd"]',
            "PREC": "ttt_linear_triton(..., precision=), rows.generic_chunk(..., precision=)"},
    "ttt_mlp": {"TTT_MLP_LAUNCH": 'util.LAUNCH["ttt_mlp_fwd"], ["ttt_mlp_bwd"]'},
}
#: Text patterns of removed names that are no module attribute: the conv's "fused" launch key (now
#: `short_conv(..., one_pass_backward=)`) and the environment variables nothing reads any more.
REMOVED_TEXT: dict[str, str] = {
    r"""_BWD\s*\[\s*["']fused["']\s*\]""": 'short_conv(..., one_pass_backward=) (no _BWD["fused"])',
    r"\bFASTWEIGHTS_NS_KERNEL\b": 'backend="torch" (or rows.pinned / a refused generic row)',
    r"\bFASTWEIGHTS_NS_PRECISION\b": "newton_schulz_gram(..., precision=), rows.generic_chunk(..., precision=)",
    r"\bFASTWEIGHTS_LAUNCH\b": "util.load_launch(path), fastweights bench speed|train --launch PATH",
}

#: {kernel module: its dotted path}; REMOVED's keys are module names (unique across the subpackages)
MODULES = triton_kernel_modules()
#: the subpackages of fastweights.kernels.triton (stages, fused, layer, memories, common)
_SUBPACKAGES = sorted({d.split(".")[3] for d in MODULES.values()} - set(MODULES))
#: the package, or one of its subpackages: what an import names before the module
_PKG = r"fastweights\.kernels\.triton(?:\.(?:" + "|".join(_SUBPACKAGES) + r"))?"
#: what follows `import`: a parenthesized list (over lines) or the rest of the line
_NAMES = r"(?:\(([\w\s,]+)\)|([\w \t,]+))"


def _imported(pattern: str, text: str):
    """(groups before the names..., [name or "name as alias" items]) of each import matching `pattern` + names."""
    for m in re.finditer(pattern + _NAMES, text):
        names = m.group(m.re.groups - 1) or m.group(m.re.groups)
        yield m.groups()[:-2], [item.strip() for item in names.split(",") if item.strip()]


def _aliases(text: str) -> dict[str, str]:
    """{name a script's code uses: kernel module} from its imports of fastweights.kernels.triton modules (in code
    and in code strings: `from fastweights.kernels.triton.fused import delta_fused, gated_fused as gf`,
    `import fastweights.kernels.triton.layer.conv as conv_k`); every module is also known by its own name."""
    out = {mod: mod for mod in REMOVED}
    for _, items in _imported(_PKG + r"\s+import\s+", text):
        for item in items:
            parts = item.split()
            if parts[0] in REMOVED:
                out[parts[-1] if len(parts) == 3 and parts[1] == "as" else parts[0]] = parts[0]
    for mod, alias in re.findall(r"import\s+" + _PKG + r"\.(\w+)\s+as\s+(\w+)", text):
        if mod in REMOVED:
            out[alias] = mod
    return out


def removed_names_in(text: str) -> list[str]:
    """'delta.FORWARD (now: …)' for each removed name `text` uses: an attribute of a kernel module under any alias
    (read or set), a name imported from one, or a REMOVED_TEXT pattern."""
    found = []
    for alias, mod in _aliases(text).items():
        for name in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)", text):
            if name in REMOVED[mod]:
                found.append(f"{mod}.{name} (now: {REMOVED[mod][name]})")
    for (mod,), items in _imported(_PKG + r"\.(\w+)\s+import\s+", text):
        for item in items:
            name = item.split()[0]
            if name in REMOVED.get(mod, {}):
                found.append(f"{mod}.{name} (now: {REMOVED[mod][name]})")
    for pattern, now in REMOVED_TEXT.items():
        found += [f"{m} (now: {now})" for m in re.findall(pattern, text)]
    return sorted(set(found))


@pytest.mark.parametrize("path", SCRIPTS + SHELL, ids=lambda p: p.name)
def test_no_script_names_a_removed_kernel_global(path):
    assert removed_names_in(path.read_text()) == []


def test_the_check_finds_removed_names_under_any_alias():
    """The scan itself: attribute reads and writes under an alias, names imported (from the package or one of its
    subpackages), code inside a string, the environment variables — and not a name that merely looks alike."""
    text = '''
from fastweights.kernels.triton import delta
from fastweights.kernels.triton.fused import delta_fused_bwd as fb, gated_fused as gf
import fastweights.kernels.triton.layer.conv as conv_k
from fastweights.kernels.triton.fused.delta_fused import FUSED_MAX_HEAD_DIM_CUDA
fb.MAX_K = 64
from fastweights.kernels.triton.gated import PIPELINE, chunk_gated_triton
delta.FORWARD = "fused"
gf.FUSED_MAX_HEAD_DIM_CUDA = 256
before = conv_k._BWD["fused"]
CASE = "from fastweights.kernels.triton import gated\\ngated.PIPELINE = 'fused'"
os.environ["FASTWEIGHTS_NS_PRECISION"] = "tf32x3"
x.FORWARD = 1; my_delta.RECOMPUTE_STATES = 0; delta.chunk_delta_triton(q)
'''
    assert removed_names_in(text) == sorted([
        'conv._BWD (now: util.LAUNCH["conv_bwd_fused"], ["conv_bwd_dpre"], ["conv_bwd_dx"])',
        "delta.FORWARD (now: DeltaPipeline.forward (pipeline= of chunk_delta_triton))",
        "delta_fused_bwd.MAX_K (now: alias: limits.DELTA_FUSED_BWD_MAX_K)",
        "delta_fused.FUSED_MAX_HEAD_DIM_CUDA (now: alias: limits.DELTA_FUSED_MAX_HEAD_DIM_CUDA)",
        "gated_fused.FUSED_MAX_HEAD_DIM_CUDA (now: alias: limits.GATED_FUSED_MAX_HEAD_DIM_CUDA)",
        "gated.PIPELINE (now: GatedPipeline.pipeline (pipeline= of chunk_gated_triton))",
        "_BWD[\"fused\"] (now: short_conv(..., one_pass_backward=) (no _BWD[\"fused\"]))",
        "FASTWEIGHTS_NS_PRECISION (now: newton_schulz_gram(..., precision=), rows.generic_chunk(..., "
        "precision=))",
    ])


def test_the_removed_names_are_gone_from_their_modules():
    """REMOVED stays true to the package: each name not marked "alias" is no attribute of its module (a name that
    comes back would make the scan wrong, not the scripts)."""
    for mod, names in REMOVED.items():
        module = importlib.import_module(MODULES[mod])
        back = [name for name, now in names.items() if not now.startswith("alias") and hasattr(module, name)]
        assert back == [], f"{mod}: {back}"
    from fastweights.kernels.triton.common.util import LAUNCH

    assert not any("fused" in LAUNCH[site] for site in LAUNCH if site.startswith("conv_"))
