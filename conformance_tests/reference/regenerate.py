"""Regenerate the recorded reference outputs of the conformance suite.

    python conformance_tests/reference/regenerate.py [tiny] [smollm2]   # needs torch, transformers,
                                                                        # llama-cpp-python
    python conformance_tests/reference/regenerate.py tiny:NAME[,NAME]   # those tiny specs only
    python conformance_tests/reference/regenerate.py SPEC [SPEC ...]    # the same, by spec names

Writes, next to this script:
  tiny_layout.json   tensor names/shapes transformers' save_pretrained writes for each tiny spec
  tiny_<name>.npz    per tiny checkpoint: its fingerprint; transformers' top-K logits over 128 positions
                     and greedy 32-token continuation (ids + log-probabilities); for llama.cpp-compatible
                     specs, llama.cpp's top-K logits on our F32 (F32 KV cache) file, and on our F16 and
                     Q8_0 files over test_vs_llama_cpp's token windows (tiny_windows) with its top-1 and
                     KL against the files' exact math (needs the Colibri engine), with the files' hashes
  smollm2_q4_1.npz   llama.cpp on SmolLM2-135M-Instruct Q4_1: token ids of the English text, top-K
                     logits, greedy continuations of the test prompts with llama.cpp's top-2 margins
The tests use these only where a reference engine is not installed (never under CI=true).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import test_converter as tc  # noqa: E402
import test_vs_llama_cpp as tl  # noqa: E402
import test_vs_transformers as tt  # noqa: E402
import tiny_models as tm  # noqa: E402

from conftest import TinyZoo  # noqa: E402


def _put(out: dict[str, np.ndarray], prefix: str, rec: dict[str, np.ndarray]) -> None:
    for k, v in rec.items():
        out[f"{prefix}_{k}"] = v


def tiny(root: Path, names: set[str] | None = None) -> None:
    """Every tiny spec's records, or those of `names` (the layout file keeps the others' entries)."""
    import colibri_backend as colibri

    zoo = TinyZoo(root)
    specs = [s for s in tm.SPECS if names is None or s.name in names]
    layout_path = HERE / "tiny_layout.json"
    layout = json.loads(layout_path.read_text()) if names is not None and layout_path.exists() else {}
    layout.update({s.name: tm.transformers_layout(s) for s in specs})
    layout_path.write_text(json.dumps(layout, indent=1, sort_keys=True))
    for spec in specs:
        ckpt = zoo.checkpoint(spec.name)
        out: dict[str, np.ndarray] = {"fingerprint": np.array(tm.checkpoint_fingerprint(ckpt))}
        ids = tm.token_ids(ckpt, tt.N_POS)
        out["ids"] = np.array(ids, dtype=np.int32)
        _put(out, "hf", tm.record(tm.transformers_logits(ckpt, ids)))
        prompt = tm.token_ids(ckpt, tt.PROMPT_LEN, seed=3)
        greedy = tm.transformers_greedy(ckpt, prompt, tt.N_GREEDY)
        out["greedy_prompt"] = np.array(prompt, dtype=np.int32)
        out["hf_greedy"] = np.array(greedy, dtype=np.int32)
        out["hf_greedy_logprobs"] = tm.greedy_logprobs(
            tm.transformers_logits(ckpt, prompt + greedy), len(prompt), greedy
        )
        if spec.llama_cpp_compatible:
            f32 = zoo.gguf(spec.name, "f32")
            out["gguf_sha_f32"] = np.array(tm.file_sha(f32))
            _put(out, "llama_f32kv", tm.record(tm.llama_cpp_logits(f32, ids, f32_kv=True)))
            windows = tl.tiny_windows(ckpt)
            out["tiny_windows"] = np.array(windows, dtype=np.int32)
            for out_type in ("f16", "q8_0"):
                g = zoo.gguf(spec.name, out_type)
                out[f"gguf_sha_{out_type}"] = np.array(tm.file_sha(g))
                theirs = tl.llama_cpp_windows(g, windows)
                _put(out, f"llama_{out_type}", tm.record(theirs))
                # llama.cpp against the file's exact math, from full logits (a top-K record gives only a
                # lower bound of that KL, which would tighten the faithfulness bar)
                vs_exact = tm.compare(tl.exact_windows(colibri, g, windows, root), theirs)
                out[f"llama_{out_type}_exact_top1"] = np.array(vs_exact.top1_agreement)
                out[f"llama_{out_type}_exact_kl"] = np.array(vs_exact.kl_mean)
                if out_type == "f16" and spec.extra.get("f16_bar") == "self_noise":
                    # llama.cpp's batched against its token-by-token pass (test_vs_llama_cpp's self noise)
                    self_noise = tm.compare(theirs, tl.llama_cpp_windows(g, windows, n_batch=1))
                    out["llama_f16_self_kl"] = np.array(self_noise.kl_mean)
                    out["llama_f16_self_top1"] = np.array(self_noise.top1_agreement)
        if spec.name == "llama":
            texts = [*tc.TOKENIZER_SAMPLES, tm.corpus_text()[5000:9000]]
            toks = tm.llama_cpp_tokenize(zoo.gguf("llama", "f32"), texts)
            out["llama_tok_ids"] = np.array([t for seq in toks for t in seq], dtype=np.int32)
            out["llama_tok_lens"] = np.array([len(seq) for seq in toks], dtype=np.int32)
        np.savez_compressed(HERE / f"tiny_{spec.name}.npz", **out)
        print(f"tiny_{spec.name}.npz", flush=True)


def smollm2() -> None:
    path = tm.resolve_smollm2()
    llm = tm.open_llama_cpp(path, vocab_only=True)
    ids = llm.tokenize(tm.english_text().encode("utf-8"), add_bos=False, special=False)[: tl.SMOL_N]
    llm.close()
    out: dict[str, np.ndarray] = {
        "gguf_sha": np.array(tm.file_sha(path)),
        "ids": np.array(ids, dtype=np.int32),
    }
    _put(out, "llama", tm.record(tm.llama_cpp_logits(path, ids)))
    for i, prompt in enumerate(tl.GREEDY_PROMPTS):
        llm = tm.open_llama_cpp(path, vocab_only=True)
        p = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
        llm.close()
        toks, rows = tl.llama_cpp_greedy(path, p, tl.GREEDY_N)
        order = np.argsort(-rows, axis=-1)
        at = np.arange(len(rows))
        out[f"greedy_{i}_prompt"] = np.array(p, dtype=np.int32)
        out[f"greedy_{i}_ids"] = np.array(toks, dtype=np.int32)
        out[f"greedy_{i}_second"] = order[:, 1].astype(np.int32)
        out[f"greedy_{i}_margins"] = (rows[at, order[:, 0]] - rows[at, order[:, 1]]).astype(np.float32)
    np.savez_compressed(HERE / "smollm2_q4_1.npz", **out)
    print("smollm2_q4_1.npz", flush=True)


def main(argv: list[str]) -> int:
    import tempfile

    # spec names (tiny_models.SPECS), or tiny:NAME,NAME, regenerate those tiny records only
    named = {a for a in argv if a in tm.SPEC_BY_NAME}
    parts = set(argv) - named or ({"tiny"} if named else {"tiny", "smollm2"})
    some = named | {n for p in parts if p.startswith("tiny:") for n in p[len("tiny:") :].split(",")}
    if "tiny" in parts or some:
        with tempfile.TemporaryDirectory(prefix="colibri-ref-") as tmp:
            tiny(Path(tmp), some or None)
    if "smollm2" in parts:
        smollm2()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
