"""Property tests (hypothesis): random shapes and dtypes for the exact identities."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastweights as fw
from fastweights import zoo
from tests.helpers import make_case, max_err
from tests.tolerances import EXACT_F64, FORMS_F32

PARALLEL = [n for n in zoo.names() if "parallel" in fw.forms(n)]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(name=st.sampled_from(PARALLEL), B=st.integers(1, 2), T=st.integers(1, 12), H=st.integers(1, 3),
       K=st.integers(1, 6), V=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31))
def test_recurrent_equals_parallel_any_shape(name, B, T, H, K, V, dtype, seed):
    inputs, state = make_case(name, T=T, B=B, H=H, K=K, V=V, seed=seed, dtype=dtype)
    o1, s1 = fw.recurrent(name, initial_state=state, output_final_state=True, **inputs)
    o2, s2 = fw.parallel(name, initial_state=state, output_final_state=True, **inputs)
    tol = EXACT_F64 if dtype == torch.float64 else FORMS_F32
    scale = 1 + o1.abs().max().item()
    assert o1.dtype == dtype
    assert (o1 - o2).abs().max().item() < tol * scale
    assert max_err(s1, s2) < tol * (1 + max(x.abs().max().item() for x in [o1]) * 10)


@SETTINGS
@given(K=st.integers(2, 8), V=st.integers(1, 6), beta=st.floats(0.05, 1.0), seed=st.integers(0, 2**31))
def test_delta_write_properties_any_shape(K, V, beta, seed):
    """A second identical β = 1 write changes nothing; orthogonal reads never change."""
    gen = torch.Generator().manual_seed(seed)
    D = torch.float64
    S = torch.randn(1, 1, K, V, dtype=D, generator=gen)
    k = torch.randn(K, dtype=D, generator=gen)
    k = k / k.norm()
    v = torch.randn(V, dtype=D, generator=gen)
    u = torch.randn(K, dtype=D, generator=gen)
    u = u - (u @ k) * k

    def write(S, b):
        _, S2 = fw.recurrent("deltanet", k.view(1, 1, 1, K), k.view(1, 1, 1, K), v.view(1, 1, 1, V),
                             beta=torch.full((1, 1, 1), b, dtype=D), initial_state=S, output_final_state=True)
        return S2

    S1 = write(S, 1.0)
    assert (write(S1, 1.0) - S1).abs().max() < EXACT_F64
    S2 = write(S, beta)
    assert ((S2[0, 0] - S[0, 0]).T @ u).abs().max() < EXACT_F64
