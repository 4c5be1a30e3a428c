"""`colibri backends`: the registered inference backends and whether they can run here."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "backends",
        help="list the registered backends and why any is unavailable",
        description="List the backends registered through the 'colibri' entry-point group, the plugin "
        "that registered each, and whether it can run here (and if not, why).",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from colibri_backend.registry import get_registry

    registry = get_registry()
    rows = []
    for entry in registry.entries():
        reason = entry.unavailable_reason()
        rows.append(
            {
                "name": entry.name,
                "plugin": entry.plugin,
                "available": reason is None,
                "reason": reason,
                "description": getattr(entry.backend, "description", ""),
            }
        )
    problems = [{"plugin": p.plugin, "problem": p.message} for p in registry.problems]
    if args.json:
        print(json.dumps({"backends": rows, "plugin_problems": problems}, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [7])
    for r in rows:
        status = "available" if r["available"] else f"unavailable: {r['reason']}"
        print(f"{r['name']:<{width}}  {status}")
        print(f"{'':<{width}}  {r['description']} (plugin {r['plugin']})")
    if not rows:
        print("no backends registered (is colibri-backend installed? its entry points declare them)")
    for prob in problems:
        print(f"plugin {prob['plugin']}: {prob['problem']}")
    return 0
