"""Load options of the expert store (colibri_backend.load, the shared CLI flags, `colibri serve`,
`colibri replay`, colibri_backend.replay_routing): parsing, the errors users see, and their effect on
the engine (slots, pinning, the routing profile) on Colibri's bundled MoE (6 layers x 32 experts, top-4).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend import budget as B
from colibri_backend import cli
from colibri_backend import profile as P
from colibri_backend.commands.serve import apply_load_options
from colibri_backend.config import Config, ModelConfig
from colibri_backend.engine import replay_routing
from colibri_backend.models import bundled_model_path
from colibri_backend.trace import RoutingTrace

N_LAYER, N_EXPERT, K = 6, 32, 4  # the bundled model's
LOADING_COMMANDS = {  # command -> the positional arguments it needs
    "run": ["prompt"],
    "chat": [],
    "serve": [],
    "trace": ["--text", "x", "-o", "t.npz"],
    "profile": ["model", "corpus.txt"],
    "replay": ["model", "trace.npz"],
    "plan": ["model"],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the bundled model, without a profile next to it."""
    dst = tmp_path_factory.mktemp("opts_model") / "moe.gguf"
    shutil.copyfile(bundled_model_path("colibri-moe"), dst)
    return dst


@pytest.fixture(scope="module")
def held_out() -> list[int]:
    with colibri_backend.load(bundled_model_path("colibri-moe"), threads=2, memory_budget=0) as m:
        text = (Path(__file__).parent / "test_budget.py").read_text(encoding="utf-8")
        return m.tokenize(text)[:160]


@pytest.fixture(scope="module")
def profile(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A routing profile of this model learned from a few stdlib-like files (this test directory)."""
    out = tmp_path_factory.mktemp("opts_profile") / "moe.routing"
    with colibri_backend.load(model_path, threads=2, memory_budget=0) as m:
        files = sorted(Path(__file__).parent.glob("test_c*.py"))
        prof = P.build_profile(m, [str(f) for f in files], context=128, max_tokens=4000)
    return P.write_profile(out, prof)


# ---- parsing ------------------------------------------------------------------------------------


def test_expert_slots_values() -> None:
    assert B.parse_expert_slots("40%", N_LAYER, N_EXPERT, K) == 77  # ceil(0.4 * 192)
    assert B.parse_expert_slots("50%", N_LAYER, N_EXPERT, K) == 96
    assert B.parse_expert_slots(" 100% ", N_LAYER, N_EXPERT, K) == 192
    assert B.parse_expert_slots("1%", N_LAYER, N_EXPERT, K) == K  # never below top-k
    assert B.parse_expert_slots(17, N_LAYER, N_EXPERT, K) == 17
    assert B.parse_expert_slots("17", N_LAYER, N_EXPERT, K) == 17
    assert B.parse_expert_slots(None, N_LAYER, N_EXPERT, K) == 0
    assert B.parse_expert_slots(0, N_LAYER, N_EXPERT, K) == 0
    for bad, msg in (
        ("abc", "whole number"),
        ("-3", "negative"),
        (-1, "negative"),
        ("x%", "percentage"),
        ("0%", "percentage"),
        ("120%", "percentage"),
        (193, "more than"),
        (1, "fewer than"),
        (True, "whole number"),
    ):
        with pytest.raises(ValueError, match=msg):
            B.parse_expert_slots(bad, N_LAYER, N_EXPERT, K)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        B.parse_expert_slots("40%", 4, 0, 0)


def test_pin_and_prefetch_values() -> None:
    assert B.parse_pin_experts("auto", 20, K) == 8  # (20 - 4) // 2
    assert B.parse_pin_experts("AUTO", 0, K) == 0  # no store: nothing to pin
    assert B.parse_pin_experts(16, 20, K) == 16
    with pytest.raises(ValueError, match="at most 16"):
        B.parse_pin_experts(17, 20, K)
    with pytest.raises(ValueError, match="negative"):
        B.parse_pin_experts(-1, 20, K)
    with pytest.raises(ValueError, match="whole number"):
        B.parse_pin_experts("many", 20, K)
    assert B.parse_prefetch("hashed") == 4
    assert B.parse_prefetch("temporal, hashed") == 6
    assert B.parse_prefetch("all") == 7 and B.parse_prefetch("both") == 3
    with pytest.raises(ValueError, match="hashed"):
        B.parse_prefetch("oracle")
    assert B.parse_share(None, "x") == 0.0 and B.parse_share("0.25", "x", upper=1.0) == 0.25
    for bad in ("-0.1", "nan", "inf", "abc"):
        with pytest.raises(ValueError):
            B.parse_share(bad, "x")
    with pytest.raises(ValueError, match="at most 1"):
        B.parse_share(1.5, "drop_cold_share", upper=1.0)


def _parse(command: str, extra: list[str]):
    return cli.build_parser().parse_args([command, *LOADING_COMMANDS[command], *extra])


@pytest.mark.parametrize("command", sorted(LOADING_COMMANDS))
def test_every_loading_command_takes_the_flags(command: str) -> None:
    args = _parse(
        command,
        [
            "--memory-budget", "512M", "--expert-slots", "40%", "--expert-policy", "lru",
            "--prefetch", "temporal,hashed", "--lookahead-depth", "2", "--lookahead-confidence", "0.1",
            "--pin-experts", "auto",
            "--route-prefilter", "1.5", "--drop-cold", "0.01", "--warmup-routing",
        ],
    )  # fmt: skip
    from colibri_backend.commands._load_options import load_options

    opts = load_options(args)
    assert isinstance(opts, colibri_backend.LoadOptions)
    assert opts.changed() == {
        "memory_budget": 512 << 20,
        "expert_slots": "40%",
        "expert_policy": "lru",
        "prefetch": "temporal,hashed",
        "lookahead_depth": 2,
        "lookahead_confidence": 0.1,
        "warmup_routing": True,
        "pin_experts": "auto",
        "route_prefilter_margin": 1.5,
        "drop_cold_share": 0.01,
    }
    assert load_options(_parse(command, [])) == colibri_backend.LoadOptions()  # unset flags: the defaults
    assert _parse(command, ["--warmup-routing=my.routing"]).warmup_routing == "my.routing"
    assert _parse(command, ["--expert-slots", "12", "--pin-experts", "3"]).expert_slots == 12


@pytest.mark.parametrize(
    "flags",
    [
        ["--expert-slots", "abc"],
        ["--expert-slots", "-3"],
        ["--expert-slots", "0%"],
        ["--pin-experts", "-1"],
        ["--lookahead-depth", "9"],
        ["--lookahead-confidence", "1"],
        ["--lookahead-confidence", "-0.5"],
        ["--route-prefilter", "-1"],
        ["--drop-cold", "2"],
        ["--memory-budget", "lots"],
        ["--prefetch", "oracle"],
        ["--expert-policy", "fifo"],
    ],
)
def test_bad_flags_are_argparse_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("run", flags)
    assert exc.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_serve_passes_load_options_to_the_colibri_backend() -> None:
    cfg = Config(
        models={
            "moe": ModelConfig(alias="moe", path="colibri-moe", backend="colibri"),
            "other": ModelConfig(alias="other", path="x.gguf", backend="llama_cpp", options={"n_gpu": 0}),
        }
    )
    Opts = colibri_backend.LoadOptions
    out = apply_load_options(cfg, ["moe", "other"], Opts(memory_budget="1G", expert_slots="40%", threads=3))
    assert out.models["moe"].memory_budget == 1 << 30 and out.models["other"].memory_budget == 1 << 30
    assert out.models["moe"].options == {"expert_slots": "40%"}  # threads are set on the alias itself
    assert out.models["other"].options == {"n_gpu": 0}  # colibri-only knobs stay off other backends
    assert apply_load_options(cfg, ["moe"], Opts(memory_budget="0")).models["moe"].memory_budget == 0
    with pytest.raises(ValueError, match="colibri backend"):
        apply_load_options(cfg, ["other"], Opts(pin_experts=4))
    # Every command-line load option is a LoadOptions field, and the colibri backend builds one
    # from an alias's options table (an unknown key there is refused, naming the known ones).
    from dataclasses import fields

    from colibri_backend.commands._load_options import LOAD_KEYS
    from colibri_backend.plugins.colibri_native import alias_options

    assert set(LOAD_KEYS) <= {f.name for f in fields(Opts)}
    moe = replace(out.models["moe"], threads=3, context_length=64)
    assert alias_options(moe) == Opts(threads=3, context_length=64, memory_budget=1 << 30, expert_slots="40%")
    with pytest.raises(ValueError, match="models.moe.options.nope: not a load option"):
        alias_options(replace(moe, options={"nope": 1}))


# ---- load() -------------------------------------------------------------------------------------


def test_warmup_routing_without_sidecar(model_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="colibri profile") as exc:
        colibri_backend.load(model_path, memory_budget=0, warmup_routing=True)
    assert str(P.profile_path(model_path)) in str(exc.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        colibri_backend.load(model_path, memory_budget=0, warmup_routing=model_path.with_suffix(".nope"))


@pytest.mark.parametrize(
    "opts, msg",
    [
        ({"prefetch": "hashed"}, "needs a routing profile"),
        ({"pin_experts": 3}, "needs a routing profile"),
        ({"route_prefilter_margin": 1.0}, "needs a routing profile"),
        ({"drop_cold_share": 0.05}, "needs a routing profile"),
        ({"lookahead_depth": 9}, "between 1 and 8"),
        ({"lookahead_confidence": 1.5}, r"lookahead_confidence must be in \[0, 1\)"),
        ({"expert_slots": "abc"}, "whole number"),
        ({"expert_slots": 200}, "more than the model's 192"),
    ],
)
def test_load_errors(model_path: Path, opts: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        colibri_backend.load(model_path, memory_budget=0, **opts)


def test_all_prefetch_without_profile_loads(model_path: Path) -> None:
    with colibri_backend.load(model_path, memory_budget=0, prefetch="all") as m:
        assert m.routing_profile is None


def test_expert_slots_reach_the_engine(model_path: Path) -> None:
    with colibri_backend.load(model_path, threads=2, expert_slots="40%", memory_budget=0) as m:
        s = m.stats()
        assert s["expert_slots"] == 77 and m.memory_plan()["n_expert_slots"] == 77
        assert s["experts_pinned"] == 0 and s["routing_profile"] is None
        for key in (
            "hashed_predicted",
            "prefetch_wasted_bytes",
            "expert_stall_decode_seconds",
            "prefilter_rows",
        ):
            assert key in s


def test_profile_pinning_and_hashed(model_path: Path, profile: Path, held_out: list[int]) -> None:
    opts = dict(threads=2, expert_slots="40%", warmup_routing=profile, pin_experts="auto", prefetch="all")
    with colibri_backend.load(model_path, **opts) as m:
        s = m.stats()
        assert s["routing_profile"] == str(profile)
        assert s["experts_pinned"] == 36  # (77 - 4) // 2
        m.reset_stats()
        m.generate(held_out[:32], max_tokens=8)
        s = m.stats()
        assert s["hashed_predicted"] > 0 and s["hashed_actual"] > 0  # "all" includes hashed with a profile
    with colibri_backend.load(
        model_path, threads=2, expert_slots=20, warmup_routing=profile, pin_experts=5
    ) as m:
        assert m.stats()["experts_pinned"] == 5
    with pytest.raises(ValueError, match="at most 16"):
        colibri_backend.load(model_path, expert_slots=20, warmup_routing=profile, pin_experts=17)


def test_replay_routing(model_path: Path, profile: Path, held_out: list[int]) -> None:
    with colibri_backend.load(model_path, threads=2, memory_budget=0) as m:
        ids = m.route(held_out)
        m.logits(held_out[:10])
        assert np.array_equal(m.routing()[0], ids[:10])  # route() is the routing of a fresh sequence
        assert m.route([]).shape == (0, N_LAYER, K)
    n = len(held_out)
    assert ids.shape == (n, N_LAYER, K)
    s = replay_routing(model_path, held_out, ids, expert_slots="40%", prefetch="none")
    assert s["expert_calls"] == n * N_LAYER * K
    assert s["expert_hits"] + s["expert_misses"] == s["expert_calls"] and s["expert_misses"] > 0
    assert s["expert_slots"] == 77 and s["prefetch_issued"] == 0
    again = replay_routing(model_path, held_out, ids, expert_slots="40%", prefetch="none")
    assert again["expert_misses"] == s["expert_misses"]  # no prefetch: deterministic
    hashed = replay_routing(
        model_path, held_out, ids, expert_slots="40%", warmup_routing=profile, prefetch="temporal,hashed"
    )
    assert hashed["hashed_predicted"] > 0 and hashed["temporal_predicted"] > 0
    assert hashed["expert_hit_rate"] > s["expert_hit_rate"]  # warm start and prefetch help
    with pytest.raises(ValueError, match="layers"):
        replay_routing(model_path, held_out, ids[:, :3], expert_slots=20)
    with pytest.raises(colibri_backend.EngineError, match="every expert"):
        replay_routing(model_path, held_out, ids, memory_budget=0)


def test_replay_command(
    model_path: Path, profile: Path, held_out: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with colibri_backend.load(model_path, threads=2, memory_budget=0) as m:
        ids = m.route(held_out)
    trace = tmp_path / "t.npz"
    RoutingTrace(ids, np.zeros(ids.shape, np.float32), np.asarray(held_out), {"model_sha256": "0" * 64}).save(
        trace
    )
    argv = ["replay", str(model_path), str(trace), "--expert-slots", "40%", f"--warmup-routing={profile}"]
    assert cli.main(argv + ["--prefetch", "all", "--json"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert r["tokens"] == len(held_out) and r["expert_slots"] == 77
    assert r["calls"] == len(held_out) * N_LAYER * K
    assert r["hashed_predicted"] > 0 and 0 <= r["hashed_precision"] <= 1 and 0 <= r["stall_share"] <= 1
    assert "another model file" in out.err  # the trace's sha256 is not this model's
    assert cli.main(argv[:3] + ["--expert-slots", "20", "--prefetch", "temporal"]) == 0
    text = capsys.readouterr().out
    assert "hit rate:" in text and "temporal predictor: precision" in text and "hashed predictor: off" in text
    assert cli.main(argv[:3]) == 1
    assert "--expert-slots" in capsys.readouterr().err


def test_serve_memory_budget_reaches_the_engine(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`colibri serve --memory-budget ... --expert-slots ...` up to a loaded colibri model (no HTTP)."""
    import colibri_backend.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda state, **kw: seen.setdefault("state", state))
    for var in ("COLIBRI_CONFIG", "COLIBRI_MODEL", "COLIBRI_MEMORY_BUDGET", "COLIBRI_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(model_path.parent)  # no colibri.toml here
    argv = ["serve", "--model", str(model_path), "--memory-budget", "64M", "--expert-slots", "40%"]
    assert cli.main(argv + ["--threads", "2", "--pin-experts", "0"]) == 0
    state = seen["state"]
    (slot,) = state.slots.values()
    assert slot.cfg.memory_budget == 64 << 20 and slot.cfg.options["expert_slots"] == "40%"
    assert slot.state == "ready", slot.error  # a single model is loaded before the server starts
    stats = slot.model.stats()
    # the engine plans with the budget less the prefix cache's share (LoadOptions.prefix_cache_size)
    assert stats["memory_budget"] + stats["prefix_cache_max_bytes"] == 64 << 20
    assert stats["expert_slots"] == 77
    slot.model.close()
