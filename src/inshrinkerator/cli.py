"""The ``inshrink`` command line: info, verify, compress, decompress, demo, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .errors import BrokenChainError, InkError
from .policies import POLICY_NAMES
from .serialize import ProgressCallback
from .single_file import open_container, save
from .tensor_classes import TENSOR_CLASSES, ClassBytes, container_class_bytes
from .tree import format_key_path, tensor_paths

__all__ = ["main"]

# Piped output gets a wide table rather than rich's 80-column default.
_console = Console(width=None if sys.stdout.isatty() else 140)
_errors = Console(stderr=True)


def human_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


@contextmanager
def _progress(label: str, enabled: bool) -> Iterator[Optional[ProgressCallback]]:
    if not enabled:
        yield None
        return
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_errors, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _is_run(path: str) -> bool:
    if os.path.isfile(path):
        return False
    from .store import is_run

    return is_run(path)


def _is_dcp(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder of the DCP integration (``.metadata.json``)."""
    if os.path.isfile(path) or ("://" not in path and not os.path.isdir(path)):
        return False
    try:
        from .integrations.dcp import is_dcp_checkpoint
    except ImportError:  # torch without torch.distributed
        return False
    return is_dcp_checkpoint(path)


def _single_file(path: str) -> str:
    """``path``, or the state file inside it when it names an ``InkTrainer`` checkpoint folder."""
    from .integrations._keyframes import TRAINER_STATE_FILE

    inside = os.path.join(path, TRAINER_STATE_FILE)
    return inside if "://" not in path and os.path.isdir(path) and os.path.isfile(inside) else path


def _print_json(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


# ----------------------------------------------------------------------------- info


def _file_summary(path: str) -> dict[str, Any]:
    from .integrations._keyframes import keyframe_path

    with open_container(path) as reader:
        try:
            keyframe = keyframe_path(reader, path)
        except BrokenChainError:  # a malformed reference: info shows the file, verify says why
            keyframe = None
        header = reader.header
        paths = tensor_paths(header.skeleton)
        size = reader.data_start + header.data_bytes
        classes = container_class_bytes(reader)
    tensors = []
    for index, record in enumerate(header.tensors):
        tensors.append(
            {
                "key": format_key_path(paths.get(index, (f"#{index}",))),
                "dtype": str(record.spec.dtype).removeprefix("torch."),
                "shape": list(record.spec.shape),
                "codec": record.codec.get("id", "?"),
                "delta": record.reference is not None,
                "raw_bytes": record.spec.nbytes,
                "stored_bytes": record.stored_bytes,
            }
        )
    raw = int(header.meta.get("raw_bytes", sum(t["raw_bytes"] for t in tensors)))
    return {
        "path": path,
        "policy": header.meta.get("policy", "?"),
        "kind": "delta" if any(t["delta"] for t in tensors) else "full",
        # A Lightning / Hugging Face checkpoint: the keyframe its deltas are against.
        "keyframe": keyframe,
        "raw_bytes": raw,
        "stored_bytes": size,
        "ratio": raw / max(size, 1),
        "tensors": tensors,
        # Weights, optimizer moments and the rest (roles from the key paths); the header is
        # in none of them.
        "classes": _class_sizes(classes),
    }


def _show_file_summary(summary: dict[str, Any]) -> None:
    against = f" against keyframe {summary['keyframe']}" if summary.get("keyframe") else ""
    table = Table(title=f"{summary['path']}  ({summary['kind']}{against}, policy {summary['policy']})")
    for column in ("tensor", "dtype", "shape", "codec", "raw", "stored", "ratio"):
        table.add_column(column, justify="right" if column in ("raw", "stored", "ratio") else "left")
    for t in summary["tensors"]:
        codec = t["codec"] + (" (delta)" if t["delta"] else "")
        # No data bytes: the tensor is its reference (or empty); the header still describes it.
        ratio = f"{t['raw_bytes'] / t['stored_bytes']:.2f}x" if t["stored_bytes"] else "-"
        table.add_row(
            t["key"], t["dtype"], str(t["shape"]), codec,
            human_bytes(t["raw_bytes"]), human_bytes(t["stored_bytes"]), ratio,
        )
    table.add_section()
    table.add_row(
        "total (whole file)", "", "", "", human_bytes(summary["raw_bytes"]),
        human_bytes(summary["stored_bytes"]), f"{summary['ratio']:.2f}x",
    )
    _console.print(table)
    _show_classes("by tensor class (data only)", summary["classes"])


def _class_sizes(classes: ClassBytes) -> dict[str, dict[str, int]]:
    # The JSON form of a class split: the classes that hold anything, in report order.
    return {
        name: {"raw_bytes": classes.raw[name], "stored_bytes": classes.stored[name]}
        for name in TENSOR_CLASSES if classes.raw[name]
    }


def _summed_classes(summaries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The class split (``_class_sizes`` form) of several files or steps together."""
    total = ClassBytes()
    for summary in summaries:
        for name, sizes in summary["classes"].items():
            total.raw[name] += sizes["raw_bytes"]
            total.stored[name] += sizes["stored_bytes"]
    return _class_sizes(total)


def _show_classes(title: str, classes: dict[str, dict[str, int]]) -> None:
    table = Table(title=title)
    for column in ("class", "raw", "stored", "ratio"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for name, sizes in classes.items():
        stored = sizes["stored_bytes"]
        table.add_row(
            name.replace("_", " "), human_bytes(sizes["raw_bytes"]), human_bytes(stored),
            f"{sizes['raw_bytes'] / stored:.2f}x" if stored else "-",
        )
    _console.print(table)


def _run_summary(path: str, classes: bool) -> list[dict[str, Any]]:
    from .store import describe_run, run_class_bytes

    entries = [entry.__dict__ if not hasattr(entry, "_asdict") else entry._asdict() for entry in describe_run(path)]
    if classes:  # one header read per step
        by_step = run_class_bytes(path)
        entries = [{**entry, "classes": _class_sizes(by_step[entry["step"]])} for entry in entries]
    return entries


def _show_run_summary(path: str, entries: list[dict[str, Any]]) -> None:
    table = Table(title=f"run {path}")
    for column in ("step", "kind", "base", "raw", "stored", "ratio", "policy"):
        table.add_column(column, justify="right" if column in ("step", "raw", "stored", "ratio", "base") else "left")
    raw = stored = 0
    for e in entries:
        raw += e["raw_bytes"]
        stored += e["stored_bytes"]
        base = "" if e.get("base_step") is None else str(e["base_step"])
        table.add_row(
            str(e["step"]), e["kind"], base, human_bytes(e["raw_bytes"]),
            human_bytes(e["stored_bytes"]), f"{e['ratio']:.2f}x", str(e["policy"]),
        )
    table.add_section()
    table.add_row("all", "", "", human_bytes(raw), human_bytes(stored), f"{raw / max(stored, 1):.2f}x", "")
    _console.print(table)
    if entries and "classes" in entries[0]:
        _show_classes("by tensor class, all steps (data only)", _summed_classes(entries))


def _dcp_summary(path: str) -> dict[str, Any]:
    from .integrations.dcp import dcp_shards

    shards = [_file_summary(f"{path.rstrip('/')}/{name}") for name in dcp_shards(path)]
    raw, stored = sum(s["raw_bytes"] for s in shards), sum(s["stored_bytes"] for s in shards)
    return {"path": path, "format": "dcp", "shards": shards, "raw_bytes": raw, "stored_bytes": stored,
            "ratio": raw / max(stored, 1), "classes": _summed_classes(shards)}


def _show_dcp_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"DCP checkpoint {summary['path']}")
    for column in ("shard", "kind", "keyframe", "raw", "stored", "ratio", "policy"):
        table.add_column(column, justify="right" if column in ("raw", "stored", "ratio") else "left")
    for shard in summary["shards"]:
        table.add_row(
            os.path.basename(shard["path"]), shard["kind"], os.path.basename(shard["keyframe"] or "") or "-",
            human_bytes(shard["raw_bytes"]), human_bytes(shard["stored_bytes"]), f"{shard['ratio']:.2f}x",
            str(shard["policy"]),
        )
    table.add_section()
    table.add_row("all shards", "", "", human_bytes(summary["raw_bytes"]), human_bytes(summary["stored_bytes"]),
                  f"{summary['ratio']:.2f}x", "")
    _console.print(table)
    _show_classes("by tensor class, all shards (data only)", summary["classes"])


def cmd_info(args: argparse.Namespace) -> int:
    if _is_run(args.path):
        entries = _run_summary(args.path, args.classes)
        _print_json(entries) if args.json else _show_run_summary(args.path, entries)
    elif _is_dcp(args.path):
        summary = _dcp_summary(args.path)
        _print_json(summary) if args.json else _show_dcp_summary(summary)
    else:
        summary = _file_summary(_single_file(args.path))
        _print_json(summary) if args.json else _show_file_summary(summary)
    return 0


# --------------------------------------------------------------------------- verify


def _verify_file(path: str, base: Optional[str]) -> list[str]:
    from .integrations._keyframes import keyframe_of, read_with_keyframe
    from .interchange import read_any
    from .serialize import read_state
    from .single_file import _base_references

    problems: list[str] = []
    try:
        with open_container(path) as reader:
            header = reader.header
            reader.verify()
            needs_base = any(r.reference is not None for r in header.tensors)
            if needs_base and base is None and keyframe_of(reader) is not None:
                read_with_keyframe(reader, path)  # a Lightning / Hugging Face checkpoint
            elif needs_base and base is None:
                problems.append(
                    f"{path}: checksums good, but tensors are deltas against a base; pass --base "
                    "to check that they restore"
                )
            else:
                references = _base_references(read_any(base)) if base else None
                read_state(reader, references)
    except InkError as exc:
        problems.append(str(exc))
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if _is_run(args.path):
        from .store import verify_run

        problems = verify_run(args.path)
    elif _is_dcp(args.path):
        from .integrations.dcp import verify_dcp

        problems = verify_dcp(args.path)
    else:
        problems = _verify_file(_single_file(args.path), args.base)
    ok = not problems
    if args.json:
        _print_json({"path": args.path, "ok": ok, "problems": problems})
    elif ok:
        _console.print(f"[green]OK[/green] {args.path}: every checksum matches and everything restores "
                       f"({time.perf_counter() - started:.2f} s)")
    else:
        for problem in problems:
            _console.print(f"[red]FAIL[/red] {problem}")
    return 0 if ok else 1


# ------------------------------------------------------------------ compress / decompress


def cmd_compress(args: argparse.Namespace) -> int:
    from .interchange import read_any

    state = read_any(args.input)
    base = read_any(args.base) if args.base else None
    with _progress("compressing", not args.json and sys.stderr.isatty()) as progress:
        info = save(state, args.output, policy=args.policy, base=base, progress=progress)
    if args.json:
        _print_json({"input": args.input, "output": args.output, **info.to_dict()})
    else:
        _console.print(
            f"{args.input} -> {args.output}: {human_bytes(info.raw_bytes)} -> "
            f"{human_bytes(info.stored_bytes)} ({info.ratio:.2f}x, {info.kind}, policy {info.policy}, "
            f"{info.seconds:.2f} s)"
        )
    return 0


def cmd_decompress(args: argparse.Namespace) -> int:
    from .interchange import read_any, write_torch_or_safetensors

    started = time.perf_counter()
    if _is_run(args.input):
        from .store import CheckpointManager

        with CheckpointManager(args.input) as manager:
            state = manager.load(args.step)
    elif _is_dcp(args.input):
        from .integrations.dcp import read_dcp

        if args.step is not None or args.base:
            raise InkError(f"{args.input} is a DCP checkpoint folder: --step and --base do not apply")
        state = read_dcp(args.input)
    else:
        if args.step is not None:
            raise InkError(f"{args.input} is a single file, not a run: --step does not apply")
        state = read_any(_single_file(args.input), base=read_any(args.base) if args.base else None)
    write_torch_or_safetensors(state, args.output)
    size = os.path.getsize(args.output)
    if args.json:
        _print_json({"input": args.input, "output": args.output, "bytes": size})
    else:
        _console.print(f"{args.input} -> {args.output}: {human_bytes(size)} "
                       f"({time.perf_counter() - started:.2f} s)")
    return 0


# ------------------------------------------------------------------------ demo / bench


def cmd_demo(args: argparse.Namespace) -> int:
    from .bench import run_demo

    run_demo(console=_console)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.activations:
        from .activations.bench import run_activation_bench

        result = run_activation_bench(out, quick=args.quick, parallel=True)
    else:
        from .bench import run_bench

        result = run_bench(
            out, quick=args.quick, workloads=args.workload, policies=args.policy, seeds=args.seeds
        )
    if args.json:
        _print_json(result)
    else:
        _console.print(f"results written to {out}/ (report.md, JSON, PNG plots)")
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inshrink", description="Compress, inspect and verify training checkpoints."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        return sub

    info = command("info", "show what a file or a run holds: sizes, kinds, ratios, policy")
    info.add_argument("path", help="an .ink file, a run directory / URL or a DCP checkpoint folder")
    info.add_argument(
        "--classes", action="store_true",
        help="for a run: each step's bytes by tensor class too (reads every step's header; a file always shows them)",
    )
    info.set_defaults(handler=cmd_info)

    verify = command("verify", "check every checksum and that everything restores (exit 1 on failure)")
    verify.add_argument("path", help="an .ink file, a run directory / URL or a DCP checkpoint folder")
    verify.add_argument("--base", help="the base a delta file was saved against")
    verify.set_defaults(handler=cmd_verify)

    compress = command("compress", "compress a .pt/.pth/.bin or .safetensors file into an .ink file")
    compress.add_argument("input")
    compress.add_argument("output")
    compress.add_argument(
        "--policy", default="lossless",
        help=f"one of: {', '.join(POLICY_NAMES)}; options after a colon, e.g. dynaquant:tolerance=0.01,bins=64|32",
    )
    compress.add_argument("--base", help="store deltas against this reference (.pt/.safetensors/.ink)")
    compress.set_defaults(handler=cmd_compress)

    decompress = command(
        "decompress", "write an .ink file, a run's step or a DCP checkpoint folder out as .pt or .safetensors"
    )
    decompress.add_argument("input", help="an .ink file, a run directory / URL or a DCP checkpoint folder")
    decompress.add_argument("output", help="a .pt/.pth/.bin or .safetensors path")
    decompress.add_argument("--base", help="the base a delta file was saved against")
    decompress.add_argument("--step", type=int, help="the step of a run (default: the latest)")
    decompress.set_defaults(handler=cmd_decompress)

    demo = command("demo", "train a CNN on real data with compressed checkpoints and failures")
    demo.set_defaults(handler=cmd_demo)

    bench = command("bench", "the failure-recovery benchmark: report.md + JSON + PNG plots")
    bench.add_argument("--quick", action="store_true", help="small sizes, under 5 minutes")
    bench.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    bench.add_argument("--workload", action="append", help="only this workload (repeatable)")
    bench.add_argument("--policy", action="append", help="only this policy (repeatable)")
    bench.add_argument("--seeds", type=int, help="number of seeds")
    bench.add_argument("--activations", action="store_true", help="the activation-compression benchmark")
    bench.set_defaults(handler=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``inshrink``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (InkError, ValueError, OSError) as exc:
        # InkError covers bad files; ValueError a bad option such as an unknown policy;
        # OSError a path that cannot be read or written. All are the user's to fix.
        _errors.print(
            f"error: {exc}", highlight=False, markup=False, style="red"
        )
        return 1
    except KeyboardInterrupt:
        _errors.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
