"""Routing profiles in the native engine, through the C API (ctypes), on tiny MoE GGUF files of three
architectures (a Q8_0 mixtral whose routers are Q8_0 too, a Q4_0 qwen2moe with a shared expert and
top-3, an olmoe without top-k renormalisation).

The profile is written here with `struct` from the model's own routing, following
native/src/profile.h. What is checked: exact routing stays bit-identical with a profile loaded, with
the pre-filter at a margin no gap reaches, and with any expert_slots; the pre-filter with a tiny
margin decides most rows from the candidates; drop-cold never routes to a dropped expert; the warm-up
and pinning keep the profile's hottest experts resident; bad profiles give clear errors.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model
from native_engine import Engine

from colibri_backend import _native as N
from colibri_backend.errors import BudgetError, EngineError, ModelFormatError

N_CTX, N_BATCH, THREADS = 96, 16, 2
PROMPT_LEN, N_GEN, PROFILE_TOKENS = 37, 8, 90
N_BUCKETS = 16

MODELS = {
    "mixtral_q8_router": dict(
        arch="mixtral",
        wtype="Q8_0",
        n_expert=12,
        n_expert_used=2,
        n_embd=128,
        n_layer=3,
        n_ff_exp=128,
        head_dim=32,
    ),
    "qwen2moe_shared": dict(
        arch="qwen2moe",
        wtype="Q4_0",
        n_expert=10,
        n_expert_used=3,
        n_embd=128,
        n_layer=2,
        n_ff_exp=128,
        n_ff_shexp=64,
        head_dim=32,
    ),
    "olmoe_f32": dict(
        arch="olmoe", wtype="F32", n_expert=8, n_expert_used=2, n_embd=64, n_layer=3, norm=False
    ),
}


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def bucket(token: int, n_buckets: int) -> int:
    shift = n_buckets.bit_length() - 1
    return 0 if n_buckets == 1 else ((token * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - shift)


def profile_bytes(model_path: Path, tokens: list[int], ids: np.ndarray, n_expert: int, n_cand: int) -> bytes:
    """A profile (profile.h layout) of the routing `ids` [T][n_layer][k] of `tokens`."""
    n_tok, n_layer, k = ids.shape
    raw = model_path.read_bytes()
    count = np.zeros((n_layer, n_expert), dtype=np.int64)
    bcount = np.zeros((N_BUCKETS, n_layer, n_expert), dtype=np.int64)
    for t in range(n_tok):
        for layer in range(n_layer):
            for e in ids[t, layer]:
                count[layer, e] += 1
                bcount[bucket(tokens[t], N_BUCKETS), layer, e] += 1
    share = (count / n_tok).astype("<f4")
    cand = np.zeros((N_BUCKETS, n_layer, n_cand), dtype="<u2")
    ex = np.arange(n_expert)
    for b in range(N_BUCKETS):
        for layer in range(n_layer):
            order = np.lexsort((ex, -count[layer], -bcount[b, layer]))  # bucket count, layer count, id
            cand[b, layer] = order[:n_cand]
    head = struct.pack(
        "<8sIIIIIIQQQ",
        b"CLBRPRF1",
        1,
        n_layer,
        n_expert,
        k,
        N_BUCKETS,
        n_cand,
        len(raw),
        fnv1a64(raw[: 1 << 20]),
        n_tok,
    )
    body = head + share.tobytes() + cand.tobytes()
    return body + struct.pack("<Q", fnv1a64(body))


class Ctx(Engine):
    """One model + context with the ABI 2 options."""

    def __init__(self, path: Path, **opts: object) -> None:
        params = N.ContextParamsC(THREADS, N_CTX, N_BATCH, 0, N.POLICY_LFU, opts.pop("prefetch", 3))
        for name, value in opts.items():
            setattr(params, name, os.fsencode(value) if name == "routing_profile" else value)
        self._open(path, params)

    def greedy(self, prompt: list[int]) -> np.ndarray:
        """Prompt logits, then N_GEN greedy steps' logits, stacked."""
        rows = [self.eval(prompt, True)]
        for _ in range(N_GEN):
            rows.append(self.eval([int(np.argmax(rows[-1][-1]))], False))
        return np.concatenate(rows)

    def routing(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids, wts = super().routing(n)
        assert len(ids) == n
        return ids, wts

    def resident(self) -> np.ndarray:
        arr = self.expert_stats()
        assert len(arr) == self.info.n_layer * self.info.n_expert
        return np.array([a.resident for a in arr], dtype=bool).reshape(self.info.n_layer, self.info.n_expert)


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = dict(MODELS[request.param])
    tmp = tmp_path_factory.mktemp("prof")
    path = tmp / f"{request.param}.gguf"
    arch = spec.pop("arch")
    types = {}
    if request.param == "mixtral_q8_router":  # the pre-filter's single-row router on quantized input
        types = {f"blk.{i}.ffn_gate_inp.weight": "Q8_0" for i in range(spec["n_layer"])}
    make_tiny_model(path, arch, seed=9, tensor_types=types, **spec)
    rng = np.random.default_rng(4)
    corpus = rng.integers(0, 301, PROFILE_TOKENS).tolist()
    with Ctx(path) as c:
        c.eval(corpus, False)
        ids, _ = c.routing(PROFILE_TOKENS)
        n_expert, k = c.info.n_expert, c.info.n_expert_used
    prof = tmp / f"{request.param}.routing"
    prof.write_bytes(profile_bytes(path, corpus, ids, n_expert, min(n_expert, k + 3)))
    # prompts from the profiled corpus: the profile knows their tokens
    prompt = corpus[:PROMPT_LEN]
    with Ctx(path) as c:
        ref = c.greedy(prompt)
        ref_ids, _ = c.routing(1)  # the last decode step
    with Ctx(path) as c:
        c.eval(prompt, False)
        prompt_ids, _ = c.routing(PROMPT_LEN)
    raw = prof.read_bytes()
    n_layer, n_cand = ids.shape[1], min(n_expert, k + 3)
    share = np.frombuffer(raw, dtype="<f4", count=n_layer * n_expert, offset=56)
    cand = np.frombuffer(raw, dtype="<u2", count=N_BUCKETS * n_layer * n_cand, offset=56 + 4 * share.size)
    return dict(
        path=path,
        profile=prof,
        prompt=prompt,
        ref=ref,
        prompt_ids=prompt_ids,
        k=k,
        n_expert=n_expert,
        n_layer=n_layer,
        share=share.reshape(n_layer, n_expert),
        cand=cand.reshape(N_BUCKETS, n_layer, n_cand),
    )


def test_exact_routing_unchanged_by_profile_slots_and_unreachable_margin(moe: dict) -> None:
    for opts in (
        dict(routing_profile=moe["profile"]),
        dict(routing_profile=moe["profile"], route_prefilter_margin=1e30, drop_cold_share=0.0),
        dict(expert_slots=moe["k"]),
        dict(expert_slots=moe["k"] + 3, routing_profile=moe["profile"], prefetch=7),
        dict(expert_slots=10_000),
    ):
        with Ctx(moe["path"], **opts) as c:
            out = c.greedy(moe["prompt"])
            s = c.stats()
        assert np.array_equal(out, moe["ref"]), opts
        if "expert_slots" in opts:
            want = min(opts["expert_slots"], moe["n_layer"] * moe["n_expert"])
            assert s.expert_slots == want and s.expert_misses > 0
        if "route_prefilter_margin" in opts:
            assert s.prefilter_rows == (PROMPT_LEN + N_GEN) * moe["n_layer"]
            assert s.prefilter_accepted == 0
            assert s.allocs_last_eval == 0


def test_prefilter_small_margin_decides_most_rows(moe: dict) -> None:
    with Ctx(moe["path"], routing_profile=moe["profile"], route_prefilter_margin=1e-4) as c:
        c.eval(moe["prompt"], False)
        ids, wts = c.routing(PROMPT_LEN)
        s = c.stats()
    assert s.prefilter_rows == PROMPT_LEN * moe["n_layer"]
    assert s.prefilter_accepted > s.prefilter_rows // 2
    # an accepted row routes among its token's candidates only
    n_layer, n_cand = moe["n_layer"], moe["cand"].shape[2]
    in_cand = [
        set(ids[t, layer]) <= set(moe["cand"][bucket(moe["prompt"][t], N_BUCKETS), layer].tolist())
        for t in range(PROMPT_LEN)
        for layer in range(n_layer)
    ]
    assert sum(in_cand) >= s.prefilter_accepted
    assert n_cand > moe["k"]
    # candidates learned from these tokens: most choices are still the exact router's
    pairs = zip(ids.reshape(-1, moe["k"]), moe["prompt_ids"].reshape(-1, moe["k"]), strict=True)
    assert sum(len(set(a) & set(b)) for a, b in pairs) > 0.5 * ids.size
    assert np.all((ids >= 0) & (ids < moe["n_expert"]))
    assert np.all(wts > 0)
    if moe["path"].stem.startswith("mixtral"):  # mixtral renormalises the top-k: weights sum to one
        assert np.allclose(wts.sum(axis=2), 1.0, atol=1e-5)


def test_drop_cold_never_routes_to_a_dropped_expert(moe: dict) -> None:
    share, k = moe["share"], moe["k"]
    thr = float(np.quantile(share, 0.6))
    ex = np.arange(moe["n_expert"])
    dropped = np.zeros_like(share, dtype=bool)
    for layer in range(moe["n_layer"]):
        hottest = np.lexsort((ex, -share[layer].astype(np.float64)))[:k]
        dropped[layer] = share[layer] < thr
        dropped[layer, hottest] = False
    assert dropped.any()
    with Ctx(moe["path"], routing_profile=moe["profile"], drop_cold_share=thr) as c:
        c.eval(moe["prompt"], False)
        ids, wts = c.routing(PROMPT_LEN)
        assert c.stats().experts_dropped == int(dropped.sum())
    layer_idx = np.arange(moe["n_layer"])[None, :, None]
    assert not dropped[layer_idx, ids].any()
    assert dropped[layer_idx, moe["prompt_ids"]].any()  # exact routing did use some of them
    assert np.all(wts > 0)


def test_warm_up_and_pinning(moe: dict) -> None:
    share, k = moe["share"], moe["k"]
    flat = share.ravel().astype(np.float64)
    hot = np.lexsort((np.arange(flat.size), -flat))
    pin = 2
    with Ctx(moe["path"], routing_profile=moe["profile"], expert_slots=pin + k + 1, pin_experts=pin) as c:
        res = c.resident().ravel()
        assert res[hot[: pin + k + 1]].all() and res.sum() == pin + k + 1
        s = c.stats()
        assert s.experts_pinned == pin and s.expert_bytes_read > 0 and s.expert_calls == 0
        out = c.greedy(moe["prompt"])
        assert c.resident().ravel()[hot[:pin]].all()
        assert c.stats().expert_misses > 0
    assert np.array_equal(out, moe["ref"])
    with pytest.raises(BudgetError, match="pin"):
        Ctx(moe["path"], routing_profile=moe["profile"], expert_slots=pin + k - 1, pin_experts=pin)


def test_bad_profiles_give_clear_errors(moe: dict, tmp_path: Path) -> None:
    missing = tmp_path / "missing.routing"
    with pytest.raises(EngineError, match="missing.routing") as e:
        Ctx(moe["path"], routing_profile=missing)
    assert e.value.status == "COLIBRI_E_IO"
    raw = bytearray(moe["profile"].read_bytes())
    raw[70] ^= 1
    broken = tmp_path / "broken.routing"
    broken.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="checksum"):
        Ctx(moe["path"], routing_profile=broken)
    broken.write_bytes(bytes(raw[:-3]))
    with pytest.raises(ModelFormatError, match="truncated"):
        Ctx(moe["path"], routing_profile=broken)
    body = bytearray(moe["profile"].read_bytes()[:-8])
    body[40:48] = struct.pack("<Q", 12345)  # another model's fingerprint, consistent checksum
    broken.write_bytes(bytes(body) + struct.pack("<Q", fnv1a64(bytes(body))))
    with pytest.raises(ModelFormatError, match="another model"):
        Ctx(moe["path"], routing_profile=broken)
    with pytest.raises(EngineError, match="needs a routing profile"):
        Ctx(moe["path"], pin_experts=1)
