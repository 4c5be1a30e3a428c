"""`colibri chat`: an interactive conversation using the model's chat template.

Each turn re-renders the whole conversation; the engine reuses the KV cache for the part that
has not changed, so only the new message is evaluated. A model's reasoning (`<think>` blocks,
gpt-oss's analysis channel) is written to stderr and left out of the conversation. /reset starts
over, /exit (or Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from colibri_backend.commands.run import add_model_arguments, load_model, report_speed, stream_to_stdout
from colibri_backend.errors import ColibriError
from colibri_backend.server.tool_calls import output_parser_for

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system message), /exit"


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    try:
        if not model.chat_template:
            raise ValueError(f"{model.name} has no chat template; use `colibri run` instead")
        system = args.system
        messages: list[dict[str, str]] = []
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"colibri chat with {model.name} ({model.info.arch}). {HELP}", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                messages.clear()
                print("(conversation cleared)", file=sys.stderr)
                continue
            if text.startswith("/system"):
                system = text[len("/system") :].strip() or None
                messages.clear()
                print("(system message set; conversation cleared)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": text})
            convo = ([{"role": "system", "content": system}] if system else []) + messages
            ids = model.chat_prompt_ids(convo)
            if len(ids) + args.max_tokens > model.context_length and len(messages) > 1:
                # Drop the oldest exchanges until the new turn fits.
                while len(messages) > 1 and len(ids) + args.max_tokens > model.context_length:
                    del messages[:2]
                    convo = ([{"role": "system", "content": system}] if system else []) + messages
                    ids = model.chat_prompt_ids(convo)
            try:
                # The model's reasoning (<think>, harmony's analysis channel) goes to stderr; the
                # conversation keeps the answer only, as chat templates expect of earlier turns.
                parser = output_parser_for(model, tools=False, prompt_text=model.render_chat(convo))
                fig, reply = stream_to_stdout(model, ids, args, parser)
            except ColibriError as exc:
                print(f"error: {exc}", file=sys.stderr)
                messages.pop()
                continue
            except KeyboardInterrupt:
                # Ctrl-C stops this reply, not the session; the unfinished turn is dropped.
                print("\n(interrupted)", file=sys.stderr)
                messages.pop()
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages.append({"role": "assistant", "content": reply})
            if args.verbose:
                report_speed(fig)
    finally:
        model.close()
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat interactively with a model (uses its chat template)",
        description="Chat with a model in the terminal (default model: smollm2, an instruction-tuned "
        "model; the bundled code model has no chat training). " + HELP,
    )
    add_model_arguments(p)
    # The bundled default model completes Python and was never taught to chat; SmolLM2-Instruct was.
    p.set_defaults(model="smollm2")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--verbose", "-v", action="store_true", help="print speed after each reply")
    p.set_defaults(func=run)
