"""The official OpenAI Python client pointed at `colibri serve`.

    colibri serve --config examples/colibri.toml          # terminal 1 (add --api-key KEY to require one)
    python examples/openai_client.py                      # terminal 2

Any OpenAI-compatible app works the same way: set its base URL to http://127.0.0.1:8000/v1.
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("COLIBRI_API_KEY", "not-needed"))
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = [m.id for m in client.models.list()]
    print("models:", ", ".join(models))
    model = models[0]

    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=32,
        temperature=0,
    )
    print("\nchat:", reply.choices[0].message.content)
    print(
        "usage:",
        reply.usage.prompt_tokens,
        "prompt +",
        reply.usage.completion_tokens,
        "completion tokens;",
        "finish_reason:",
        reply.choices[0].finish_reason,
    )

    print("\nstreaming: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=40,
        temperature=0.7,
        seed=42,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    completion = client.completions.create(
        model=model,
        prompt="The three primary colours are",
        max_tokens=16,
        temperature=0,
        stop=["\n"],
        logprobs=2,
    )
    print("\ncompletion:", repr(completion.choices[0].text))
    lp = completion.choices[0].logprobs
    print(
        "first tokens and logprobs:",
        list(zip(lp.tokens[:4], [round(x, 3) for x in lp.token_logprobs[:4]], strict=False)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
