"""Colibri behind transformers' Auto classes: ColibriConfig and ColibriForCausalLM.

    import colibri_backend.transformers_glue            # registers "colibri" with the Auto classes
    from transformers import pipeline
    from colibri_backend.transformers_glue import ColibriForCausalLM

    model = ColibriForCausalLM.from_pretrained("model.gguf", threads=2)  # or a HF checkpoint dir, "smollm2"
    pipe = pipeline("text-generation", model=model, tokenizer=model.get_tokenizer())
    model.save_pretrained("colibri-model")     # config.json (model_type "colibri") + tokenizer files
    pipe = pipeline("text-generation", model="colibri-model")                # through the Auto classes

Importing this module imports torch and transformers and registers the classes the way transformers
documents for custom models (``AutoConfig.register`` and ``AutoModelForCausalLM.register``); ``import
colibri_backend`` imports neither and changes nothing in transformers.

What runs where: the native engine computes the logits and does the sampling. `generate()` maps transformers'
generation arguments (max_new_tokens / max_length, do_sample, temperature, top_p, top_k, min_p,
repetition_penalty, eos_token_id, pad_token_id, stop_strings, streamer, num_return_sequences) onto the native
sampler through `SamplingParams.from_generation_config`, one sequence at a time (the engine holds one KV
cache), so batches work with left padding and greedy output is what the engine's argmax gives.
`forward()` returns logits like any causal LM: with `logits_to_keep=1` (what GenerationMixin asks for) only
the last position is evaluated and the engine's KV cache is kept whenever the new input extends what is
cached.

Arguments that would need the model's internals (beam search, output_scores, custom logits processors,
assistant models, ...) are refused with a ValueError rather than silently ignored.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast

from colibri_backend.adapters.sampling import SamplingParams

log = logging.getLogger("colibri.transformers")

MODEL_TYPE = "colibri"
GGUF_FILE_NAME = "model.gguf"

__all__ = ["GGUF_FILE_NAME", "MODEL_TYPE", "ColibriConfig", "ColibriForCausalLM"]

# generate() options that only make sense with access to the model's internals or a different search.
_UNSUPPORTED_FLAGS = {
    "output_scores": "scores",
    "output_logits": "logits",
    "output_attentions": "attentions",
    "output_hidden_states": "hidden states",
}
_UNSUPPORTED_KWARGS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "synced_gpus",
)


# ---------------------------------------------------------------------------------------------------------
# helpers that do not need torch


def _is_colibri_dir(path: Path) -> bool:
    cfg = path / "config.json"
    if not (path.is_dir() and cfg.is_file()):
        return False
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def _gguf_of_colibri_dir(path: Path, gguf_path: str | None) -> Path:
    if not gguf_path:
        candidate = path / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
        raise FileNotFoundError(f"{path}: config.json names no gguf_path and there is no {GGUF_FILE_NAME}")
    p = Path(gguf_path).expanduser()
    if not p.is_absolute():
        p = path / p
    if not p.is_file():
        raise FileNotFoundError(f"{path}: the model file {p} named in config.json does not exist")
    return p


def _load_engine(
    source: str | os.PathLike[str], threads: int | None, context_length: int | None, memory_budget: Any
) -> Any:
    import colibri_backend

    opts = colibri_backend.LoadOptions(
        threads=threads, context_length=context_length, memory_budget=memory_budget
    )
    return colibri_backend.load(source, opts)


def _row_tokens(ids: list[int], mask: list[int] | None, pad_id: int | None) -> tuple[int, int]:
    """(start, end) of the real tokens of one row: the span the attention mask (or, without one, the
    absence of left/right padding with pad_id) marks. Holes inside the span are refused."""
    n = len(ids)
    if mask is None:
        if pad_id is None:
            return 0, n
        start, end = 0, n
        while start < end and ids[start] == pad_id:
            start += 1
        while end > start and ids[end - 1] == pad_id:
            end -= 1
        # A row made only of the pad token (or a pad token that is also real text) keeps its last token.
        return (start, end) if end > start else (max(n - 1, 0), n)
    ones = [i for i, m in enumerate(mask) if m]
    if not ones:
        return n, n
    start, end = ones[0], ones[-1] + 1
    if end - start != len(ones):
        raise ValueError(
            "the attention mask has holes inside a sequence; only left or right padding is supported"
        )
    return start, end


def _derived_seed(base: int, *parts: int) -> int:
    data = ",".join(str(p) for p in (base, *parts)).encode()
    return (zlib.crc32(data) << 32 | zlib.adler32(data)) & 0x7FFFFFFFFFFFFFFF


# ---------------------------------------------------------------------------------------------------------
# the classes


class ColibriConfig(PretrainedConfig):
    """Configuration of a model run by the Colibri engine.

    `gguf_path` locates the weights (relative paths are relative to the directory the config is in);
    `threads`, `context_length` and `memory_budget` are passed to the engine. The dimensions mirror the
    engine's model info so that tools reading the config (sizes, context) see the real model.
    """

    model_type = MODEL_TYPE

    gguf_path: str | None = None
    threads: int | None = None
    context_length: int | None = None
    memory_budget: int | str | None = None
    arch: str = ""
    vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    max_position_embeddings: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = False


class ColibriForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose forward pass and sampling run in Colibri's native engine."""

    config_class = ColibriConfig
    base_model_prefix = "colibri"
    main_input_name = "input_ids"
    _supports_cache_class = False
    _is_stateful = True  # the engine keeps its own KV cache; transformers must not build one

    def __init__(self, config: ColibriConfig, engine: Any = None) -> None:
        super().__init__(config)
        self._engine = engine
        self._tokenizer: Any = None
        self._hf_dir: Path | None = None
        self.post_init()

    # ---- loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *model_args: Any,
        config: Any = None,
        threads: int | None = None,
        context_length: int | None = None,
        memory_budget: int | str | None = None,
        **kwargs: Any,
    ) -> ColibriForCausalLM:
        """Load a GGUF file, a directory written by save_pretrained, a Hugging Face checkpoint directory
        (converted once by colibri_backend and cached) or a known model name such as "smollm2".

        threads / context_length / memory_budget go to the engine (memory_budget is kept in the config
        and passed on once the engine supports budgets). Hub and torch options transformers passes along
        (revision, dtype, device_map, ...) are accepted and ignored: the weights stay in the engine.
        """
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no positional model arguments")
        device_map = kwargs.get("device_map")
        if device_map not in (None, "cpu", "auto") and str(device_map) != "cpu":
            raise ValueError(f"Colibri runs on the CPU; device_map={device_map!r} is not supported")
        source = Path(os.fspath(pretrained_model_name_or_path)).expanduser()
        saved: dict[str, Any] = {}
        target: str | os.PathLike[str] = pretrained_model_name_or_path
        if _is_colibri_dir(source):
            saved = json.loads((source / "config.json").read_text(encoding="utf-8"))
            if config is not None and getattr(config, "gguf_path", None):
                saved["gguf_path"] = config.gguf_path
            target = _gguf_of_colibri_dir(source, saved.get("gguf_path"))
        threads = threads if threads is not None else saved.get("threads")
        context_length = context_length if context_length is not None else saved.get("context_length")
        memory_budget = memory_budget if memory_budget is not None else saved.get("memory_budget")
        engine = _load_engine(target, threads, context_length, memory_budget)
        try:
            cfg = cls._config_from_engine(engine, threads, context_length, memory_budget)
            cfg._name_or_path = os.fspath(pretrained_model_name_or_path)
            model = cls(cfg, engine=engine)
            if _is_colibri_dir(source):
                model._hf_dir = source
            elif getattr(engine, "hf_dir", None) is not None:
                model._hf_dir = Path(engine.hf_dir)
            model.generation_config = model._generation_config_for(source)
        except BaseException:
            engine.close()
            raise
        model.eval()
        return model

    @classmethod
    def _config_from_engine(
        cls, engine: Any, threads: int | None, context_length: int | None, memory_budget: Any
    ) -> ColibriConfig:
        info = engine.info
        tok = engine.tokenizer
        eos = sorted(getattr(tok, "stop_token_ids", ()) or ())
        eos_id: int | list[int] | None
        if info.eos_token_id is not None and info.eos_token_id >= 0:
            eos = [int(info.eos_token_id)] + [t for t in eos if t != info.eos_token_id]
        eos_id = eos[0] if len(eos) == 1 else (eos or None)
        bos = info.bos_token_id if info.bos_token_id is not None and info.bos_token_id >= 0 else None
        return ColibriConfig(
            gguf_path=str(Path(engine.path).resolve()),
            threads=threads,
            context_length=context_length,
            memory_budget=memory_budget,
            arch=info.arch,
            vocab_size=info.n_vocab,
            hidden_size=info.n_embd,
            num_hidden_layers=info.n_layer,
            num_attention_heads=info.n_head,
            num_key_value_heads=info.n_head_kv,
            head_dim=info.head_dim,
            intermediate_size=info.n_ff,
            num_local_experts=info.n_expert,
            num_experts_per_tok=info.n_expert_used,
            moe_intermediate_size=info.n_ff_exp,
            max_position_embeddings=engine.context_length,
            bos_token_id=bos,
            eos_token_id=eos_id,
            pad_token_id=eos[0] if eos else None,
        )

    def _generation_config_for(self, source: Path) -> GenerationConfig:
        """The checkpoint's generation_config.json when there is one, else one from the config."""
        for d in (source if source.is_dir() else None, self._hf_dir):
            if d is not None and (d / "generation_config.json").is_file():
                try:
                    gc = GenerationConfig.from_pretrained(d)
                    if gc.pad_token_id is None:
                        gc.pad_token_id = self.config.pad_token_id
                    return gc
                except (OSError, ValueError) as exc:
                    log.warning("ignoring %s/generation_config.json: %s", d, exc)
        return GenerationConfig(
            bos_token_id=self.config.bos_token_id,
            eos_token_id=self.config.eos_token_id,
            pad_token_id=self.config.pad_token_id,
        )

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], copy_gguf: bool = False, **kwargs: Any
    ) -> None:
        """Write a directory that from_pretrained and the Auto classes (and so pipeline(model=DIR)) load.

        It holds config.json (model_type "colibri"), generation_config.json and the tokenizer files.
        The GGUF is referenced by absolute path, or copied in as model.gguf with copy_gguf=True.
        """
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = copy.deepcopy(self.config)
        src = Path(self.engine.path).resolve()
        if copy_gguf:
            dest = out / GGUF_FILE_NAME
            if not dest.exists() or not dest.samefile(src):
                shutil.copy2(src, dest)
            cfg.gguf_path = GGUF_FILE_NAME
        else:
            cfg.gguf_path = str(src)
        cfg.save_pretrained(out)
        self.generation_config.save_pretrained(out)
        self.get_tokenizer().save_pretrained(out)

    # ---- engine and tokenizer -----------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The colibri_backend Model (native engine) behind this module."""
        if self._engine is None:
            raise ValueError("this ColibriForCausalLM has no engine; create it with from_pretrained()")
        return self._engine

    def get_tokenizer(self) -> Any:
        """A transformers fast tokenizer equivalent to the engine's (left padding, chat template)."""
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def _make_tokenizer(self) -> Any:
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if self._hf_dir is not None and (self._hf_dir / "tokenizer.json").is_file():
            tok = AutoTokenizer.from_pretrained(self._hf_dir)
        else:
            engine = self.engine
            base = engine.tokenizer
            tok = PreTrainedTokenizerFast(
                tokenizer_object=HFTokenizer.from_str(base.hf.to_str()),
                bos_token=base.bos_token,
                eos_token=base.eos_token,
                model_max_length=engine.context_length,
                clean_up_tokenization_spaces=False,
            )
            if engine.chat_template:
                tok.chat_template = engine.chat_template
        tok.padding_side = "left"
        if tok.pad_token is None:
            pad = self.config.pad_token_id
            tok.pad_token = tok.eos_token if pad is None else tok.convert_ids_to_tokens(int(pad))
        return tok

    def close(self) -> None:
        """Release the native engine now (it is released with the object otherwise)."""
        if self._engine is not None:
            self._engine.close()

    # The weights live in the engine, on the CPU; logits come back as float32 tensors.
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    # transformers calls these on every causal LM; there are no torch weights to touch.
    def get_input_embeddings(self) -> Any:
        return None

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        from colibri_backend.errors import ColibriError

        raise ColibriError("Colibri's weights live in the GGUF file; the embeddings cannot be resized")

    def _init_weights(self, module: Any) -> None:
        pass

    # ---- forward ------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Logits [batch, positions, vocab] (float32) for input_ids, as any causal LM returns them.

        logits_to_keep=k > 0 returns only the last k positions; k=1 evaluates only tokens the engine's
        KV cache does not already hold (what generation needs). Padding positions get zero logits.
        With labels, the loss is the usual shifted cross-entropy (labels -100 ignored).
        """
        if input_ids is None:
            raise ValueError("ColibriForCausalLM needs input_ids (inputs_embeds are not supported)")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ColibriForCausalLM does not accept inputs_embeds")
        ids = input_ids.detach().cpu().long()
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        batch, seq = ids.shape
        mask = attention_mask.detach().cpu().long() if attention_mask is not None else None
        keep = seq if not logits_to_keep or logits_to_keep >= seq else int(logits_to_keep)
        logits = torch.zeros(batch, keep, self.config.vocab_size, dtype=torch.float32)
        engine = self.engine
        for b in range(batch):
            row = ids[b].tolist()
            start, end = _row_tokens(row, mask[b].tolist() if mask is not None else None, None)
            if end <= start:
                continue
            real = row[start:end]
            if keep == 1 and end == seq:
                logits[b, 0] = torch.from_numpy(np.asarray(engine.next_logits(real)))
                continue
            full = torch.from_numpy(np.asarray(engine.logits(real)))  # rows start..end-1
            lo = seq - keep  # first kept position
            src_lo, src_hi = max(start, lo), end
            if src_hi > src_lo:
                logits[b, src_lo - lo : src_hi - lo] = full[src_lo - start : src_hi - start]
        loss = None
        if labels is not None:
            if keep != seq:
                raise ValueError("labels need the logits of every position (logits_to_keep=0)")
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
            shift_labels = labels.detach().cpu().long()[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=None)

    # ---- generation ---------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        streamer: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' generate(), run by the native sampler; see the module docstring."""
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        if input_ids is None:
            bos = self.config.bos_token_id
            if bos is None:
                raise ValueError("generate() needs input_ids (the model has no BOS token to start from)")
            input_ids = torch.tensor([[bos]], dtype=torch.long)
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        for name in _UNSUPPORTED_KWARGS:
            value = kwargs.pop(name, None)
            if value:  # None and empty lists are harmless
                raise ValueError(f"generate({name}=...) is not supported by the Colibri engine")
        kwargs.pop("tokenizer", None)
        kwargs.pop("use_cache", None)
        kwargs.pop("past_key_values", None)
        base = generation_config if generation_config is not None else self.generation_config
        gen = copy.deepcopy(base)
        unused = {k: v for k, v in gen.update(**kwargs).items() if v is not None}
        if unused:
            raise ValueError(f"generate() got arguments the Colibri engine does not use: {sorted(unused)}")
        self._check_generation_config(gen)

        batch, seq = input_ids.shape
        n_ret = int(gen.num_return_sequences or 1)
        if streamer is not None and batch * n_ret != 1:
            raise ValueError("a streamer needs a single sequence (batch size 1, num_return_sequences 1)")
        if gen.max_new_tokens is not None:
            max_new = int(gen.max_new_tokens)
        else:
            max_new = max(int(gen.max_length if gen.max_length is not None else 20) - seq, 0)
        eos = gen.eos_token_id
        eos_set = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        if hasattr(eos, "tolist"):
            eos_set = {int(e) for e in eos.reshape(-1).tolist()}
        pad_id = gen.pad_token_id if gen.pad_token_id is not None else (min(eos_set) if eos_set else 0)
        pad_id = int(pad_id)
        sp = SamplingParams.from_generation_config(gen)
        stops = list(sp.stop)

        ids_cpu = input_ids.detach().cpu().long()
        mask = attention_mask.detach().cpu().long() if attention_mask is not None else None
        if streamer is not None:
            streamer.put(ids_cpu)
        rows: list[list[int]] = []
        for b in range(batch):
            row = ids_cpu[b].tolist()
            start, end = _row_tokens(
                row, mask[b].tolist() if mask is not None else None, pad_id if mask is None else None
            )
            if end < seq:
                raise ValueError(
                    "right padding in generate() inputs: pad on the left (tokenizer.padding_side = 'left')"
                )
            prompt = row[start:end]
            if not prompt:
                raise ValueError(f"row {b} of the batch has no tokens to continue")
            for _ in range(n_ret):
                seed = int(torch.randint(0, 2**62, (1,)).item()) if not sp.greedy else 0
                new = self._generate_row(prompt, max_new, sp, eos_set, stops, seed, streamer)
                rows.append(row + new)
        if streamer is not None:
            streamer.end()
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        if gen.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=out)
        return out

    def _check_generation_config(self, gen: GenerationConfig) -> None:
        problems = []
        if (gen.num_beams or 1) > 1:
            problems.append("num_beams > 1 (beam search)")
        if (getattr(gen, "num_beam_groups", 1) or 1) > 1:
            problems.append("num_beam_groups > 1")
        for flag, what in _UNSUPPORTED_FLAGS.items():
            if getattr(gen, flag, False):
                problems.append(f"{flag} ({what} are not exposed by the engine)")
        for name, neutral in (
            ("typical_p", 1.0),
            ("epsilon_cutoff", 0.0),
            ("eta_cutoff", 0.0),
            ("no_repeat_ngram_size", 0),
            ("encoder_repetition_penalty", 1.0),
            ("guidance_scale", None),
            ("penalty_alpha", None),
            ("min_new_tokens", None),
            ("bad_words_ids", None),
            ("force_words_ids", None),
            ("sequence_bias", None),
            ("suppress_tokens", None),
            ("begin_suppress_tokens", None),
            ("forced_bos_token_id", None),
            ("forced_eos_token_id", None),
            ("constraints", None),
            ("watermarking_config", None),
        ):
            value = getattr(gen, name, neutral)
            if value is None or value == neutral or (not isinstance(value, (int, float)) and not value):
                continue
            problems.append(f"{name}={value!r}")
        if getattr(gen, "min_length", 0) not in (0, None):
            problems.append(f"min_length={gen.min_length}")
        if problems:
            raise ValueError("generate() options not supported by the Colibri engine: " + ", ".join(problems))

    def _generate_row(
        self,
        prompt: list[int],
        max_new: int,
        sp: Any,
        eos_set: set[int],
        stops: list[str],
        seed: int,
        streamer: Any,
    ) -> list[int]:
        """New tokens for one sequence. The engine stops on its own end tokens; generation continues
        through those that are not in this call's eos_token_id set (as transformers would)."""
        from dataclasses import replace

        engine = self.engine
        engine_stops = set(getattr(engine.tokenizer, "stop_token_ids", ()) or ())
        out: list[int] = []
        while len(out) < max_new:
            params = replace(sp, seed=_derived_seed(seed, len(out)) if not sp.greedy else None, stop=[])
            events = engine.generate_tokens(
                prompt + out,
                max_tokens=max_new - len(out),
                sampling=params,
                stop=stops or None,
                logprobs=None,
            )
            resume = False
            try:
                for ev in events:
                    out.append(int(ev.token_id))
                    if streamer is not None:
                        streamer.put(torch.tensor([ev.token_id], dtype=torch.long))
                    if ev.token_id in eos_set:
                        return out
                    if ev.finish_reason == "stop":
                        # An engine end token that this call does not treat as EOS: keep going.
                        resume = ev.token_id in engine_stops
                        break
                    if ev.finish_reason == "length":
                        return out
            finally:
                events.close()
            if not resume:
                break
        return out

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs: Any) -> dict[str, Any]:
        # Only used if someone drives this model with GenerationMixin's own loop: the whole sequence goes
        # in every step and forward() reuses the engine's cache for the common prefix.
        return {
            "input_ids": input_ids,
            "attention_mask": kwargs.get("attention_mask"),
            "logits_to_keep": 1,
        }


AutoConfig.register(MODEL_TYPE, ColibriConfig, exist_ok=True)
AutoModelForCausalLM.register(ColibriConfig, ColibriForCausalLM, exist_ok=True)
