"""Coverage-guided fuzzing (atheris, libFuzzer's engine for Python) of the Python readers that take
untrusted input: chat templates (adapters/chat_template.py, the template source comes from the GGUF),
GGUF metadata (adapters/gguf_metadata.py), routing profiles (colibri_backend/profile.py) and routing
traces (colibri_backend/trace.py, .jsonl and .npz).

    python tools/fuzz_python.py TARGET [libFuzzer options, e.g. -max_total_time=20] [CORPUS_DIR]
    python tools/fuzz_python.py --make-corpus        # writes tests/fuzz_corpus/<target>/

Each target states the exceptions its reader is documented to raise on bad input; any other
exception (IndexError, KeyError, RecursionError, a numpy error, ...) is a finding and stops the run
with the input saved as crash-*. tests/test_fuzz.py runs every target briefly.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fuzz_corpus"
_SCRATCH = Path(tempfile.gettempdir()) / f"colibri-pyfuzz-{os.getpid()}"


def _scratch(name: str, data: bytes) -> Path:
    _SCRATCH.mkdir(exist_ok=True)
    p = _SCRATCH / name
    p.write_bytes(data)
    return p


def fuzz_chat_template(data: bytes) -> None:
    """Template source and messages from the input: a str, or ChatTemplateError."""
    import atheris

    from colibri_backend.adapters.chat_template import ChatTemplateError, render_chat

    fdp = atheris.FuzzedDataProvider(data)
    source = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 2048))
    messages = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        role = ["system", "user", "assistant", "tool", fdp.ConsumeUnicodeNoSurrogates(8)][
            fdp.ConsumeIntInRange(0, 4)
        ]
        messages.append({"role": role, "content": fdp.ConsumeUnicodeNoSurrogates(64)})
    try:
        out = render_chat(
            source, messages, add_generation_prompt=fdp.ConsumeBool(), bos_token="<s>", eos_token="</s>"
        )
    except ChatTemplateError:
        return
    assert isinstance(out, str)


def fuzz_gguf_metadata(data: bytes) -> None:
    """Any bytes: a dict, or ModelFormatError."""
    from colibri_backend.adapters.gguf_metadata import read_metadata
    from colibri_backend.errors import ModelFormatError

    try:
        meta = read_metadata(_scratch("m.gguf", data))
    except ModelFormatError:
        return
    assert isinstance(meta, dict)


def fuzz_profile(data: bytes) -> None:
    """Any bytes: a RoutingProfile whose arrays respect the format, or ValueError."""
    from colibri_backend.profile import read_profile

    try:
        prof = read_profile(_scratch("p.routing", data))
    except ValueError:
        return
    assert prof.cand.max() < prof.n_expert and prof.share.shape == (prof.n_layer, prof.n_expert)


def fuzz_trace(data: bytes) -> None:
    """Any bytes as .jsonl or .npz (first byte): a RoutingTrace, or ValueError."""
    from colibri_backend.trace import load_trace

    if not data:
        return
    name = "t.npz" if data[0] & 1 else "t.jsonl"
    try:
        trace = load_trace(_scratch(name, data[1:]))
    except ValueError:
        return
    assert trace.n_tokens >= 0


TARGETS = {
    "chat_template": fuzz_chat_template,
    "gguf_metadata": fuzz_gguf_metadata,
    "profile": fuzz_profile,
    "trace": fuzz_trace,
}


def make_corpus() -> None:
    """Seeds: real templates and files written by the project's own writers (deterministic)."""
    import numpy as np

    from colibri_backend.profile import RoutingProfile, profile_bytes

    def put(target: str, name: str, data: bytes) -> None:
        d = CORPUS / target
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)

    templates = {
        "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "llama2": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
        "[INST] {{ m['content'] | trim }} [/INST]{% elif m['role'] == 'assistant' %} "
        "{{ m['content'] }}{{ eos_token }}{% else %}"
        "{{ raise_exception('bad role') }}{% endif %}{% endfor %}",
        "tojson": "{{ messages | tojson }}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{% if loop.last %}{{ ns.n }}{% endif %}{% endfor %}",
    }
    for name, src in templates.items():
        raw = src.encode()
        # FuzzedDataProvider reads lengths from the end; a seed need not be exact, only close
        put("chat_template", name, raw + b"user\x00hello there\x00assistant\x00hi\x00" + bytes([4, 2, 1]))
    bundled = ROOT / "colibri_backend" / "models" / "colibri-moe-q8_0.gguf"
    with open(bundled, "rb") as f:
        head = f.read(4096)
    put("gguf_metadata", "bundled_head.gguf", head)
    rng = np.random.default_rng(5)
    share = np.full((2, 4), 0.5, np.float32)
    cand = np.stack([np.stack([rng.permutation(4)[:3] for _ in range(2)]) for _ in range(4)]).astype(
        np.uint16
    )
    put("profile", "small.routing", profile_bytes(RoutingProfile(2, 10, 123, 456, share, cand)))
    from colibri_backend.trace import RoutingTrace

    trace = RoutingTrace(
        ids=np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]]),
        weights=np.full((2, 2, 2), 0.5, np.float32),
        tokens=np.array([7, 8]),
        meta={"model": "seed", "n_expert": 4},
    )
    tmp = Path(tempfile.mkdtemp())
    for suffix, first in ((".jsonl", b"\x00"), (".npz", b"\x01")):
        trace.save(tmp / f"t{suffix}", pieces=["a", "b"])
        put("trace", f"small{suffix}", first + (tmp / f"t{suffix}").read_bytes())
    print(f"wrote {sum(1 for _ in CORPUS.rglob('*') if _.is_file())} seeds under {CORPUS}")


def main() -> None:
    if sys.argv[1:] == ["--make-corpus"]:
        make_corpus()
        return
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(
            f"usage: {sys.argv[0]} ({'|'.join(TARGETS)}) [libFuzzer options] [CORPUS_DIR] | --make-corpus"
        )
    import atheris

    target = TARGETS[sys.argv[1]]
    import inspect

    import colibri_backend.adapters.chat_template
    import colibri_backend.adapters.gguf_metadata
    import colibri_backend.profile
    import colibri_backend.trace

    # Coverage of the readers themselves: every function and method defined in these modules, and
    # jinja2's for templates (instrument_imports misses modules that the editable install's import
    # hook loads, and instrument_all would spend a minute on numpy and the rest).
    mods = [
        colibri_backend.adapters.chat_template,
        colibri_backend.adapters.gguf_metadata,
        colibri_backend.profile,
        colibri_backend.trace,
    ]
    if sys.argv[1] == "chat_template":  # the template source goes through jinja2's lexer, parser and compiler
        mods += [m for name, m in sorted(sys.modules.items()) if name.startswith("jinja2") and m is not None]
    for mod in mods:
        for obj in list(vars(mod).values()):
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for fn in members:
                if inspect.isfunction(fn) and fn.__module__ == mod.__name__:
                    atheris.instrument_func(fn)
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
