"""Compressed torch.distributed.checkpoint (DCP) shards on every rank, then a resume.

Run on the CPU with two processes::

    torchrun --standalone --nproc_per_node=2 examples/dcp_torchrun.py --phase save --out /tmp/dcp
    torchrun --standalone --nproc_per_node=2 examples/dcp_torchrun.py --phase resume --out /tmp/dcp

``save`` trains a small MLP twice — replicated with DDP, and sharded with FSDP2 — for
``--steps`` steps, checkpoints each at ``--save-at`` (DDP with ``dcp.save``, FSDP2 with
``dcp.async_save``) and keeps training to the end: that is the uninterrupted run. ``resume``
starts from scratch in new processes, loads the checkpoints and trains to the end. Each
rank writes a JSON report under ``--out``; rank 0 prints the comparison.

``--keyframes`` checkpoints at half of ``--save-at`` too, through one ``InkKeyframes`` per
run: the first checkpoint writes each rank's keyframe, the second is a delta against it
(the one the resume loads). The resume then loads through its own ``InkKeyframes`` and
checkpoints once more at the end, a delta against the keyframe it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from inshrinkerator.integrations.dcp import (
    InkKeyframes,
    InkLoadPlanner,
    InkSavePlanner,
    InkStorageReader,
    InkStorageWriter,
)

WIDTH = 64


def build(mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(2 * WIDTH, 8)
    )
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data at ``step``: a function of the step, so a resume replays it."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(32, WIDTH, generator=generator)
    return x, (x[:, :8] * 2).tanh()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def evaluate(model: torch.nn.Module) -> float:
    x, y = batch(10_000)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def folder_of(out: Path, mode: str, args: argparse.Namespace) -> str:
    """The checkpoint folder the resume loads."""
    return str(out / mode / f"step-{args.save_at}") if args.keyframes else str(out / f"{mode}-step-{args.save_at}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--policy", default=None, help="inshrinkerator policy (default: the default)")
    parser.add_argument("--modes", default="ddp,fsdp")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-at", type=int, default=6)
    parser.add_argument("--keyframes", action="store_true",
                        help="checkpoint at half of --save-at too; the later checkpoint is a delta")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(args.out)
    report: dict = {"rank": rank}
    for mode in args.modes.split(","):
        model, optimizer = build(mode)
        folder = folder_of(out, mode, args)
        if args.phase == "save":
            keyframes = InkKeyframes(out / mode, policy=args.policy) if args.keyframes else None
            saves = [args.save_at // 2, args.save_at] if args.keyframes else [args.save_at]
            trained, stored = 0, []
            for step in saves:
                train(model, optimizer, trained, step)
                trained = step
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optim": optim_state, "step": step}
                writer = (InkStorageWriter(out / mode / f"step-{step}", keyframes=keyframes) if keyframes
                          else InkStorageWriter(folder, policy=args.policy))
                if mode == "ddp":
                    dcp.save(state, storage_writer=writer, planner=InkSavePlanner())
                else:
                    pending = dcp.async_save(state, storage_writer=writer, planner=InkSavePlanner())
                    (pending.upload_completion if hasattr(pending, "upload_completion") else pending).result()
                stored.append(writer.last_info["stored_bytes"])
            # DCP's own format, for the size comparison.
            dcp.save(state, checkpoint_id=str(out / f"{mode}-default"))
            train(model, optimizer, args.save_at, args.steps)
            report[mode] = {"shard": writer.last_shard, **writer.last_info, "stored_per_save": stored,
                            "final_loss": evaluate(model)}
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": -1}
            keyframes = InkKeyframes(out / mode, policy=args.policy) if args.keyframes else None
            reader = InkStorageReader(folder, keyframes=keyframes)
            dcp.load(state, storage_reader=reader, planner=InkLoadPlanner())
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            train(model, optimizer, state["step"], args.steps)
            report[mode] = {"shards_read": reader.shards_read, "step": state["step"],
                            "final_loss": evaluate(model)}
            if keyframes is not None:  # goes on with the keyframe it loaded: a delta
                model_state, optim_state = get_state_dict(model, optimizer)
                writer = InkStorageWriter(out / mode / f"step-{args.steps}", keyframes=keyframes)
                dcp.save({"model": model_state, "optim": optim_state, "step": args.steps}, storage_writer=writer,
                         planner=InkSavePlanner())
                report[mode]["stored_at_end"] = writer.last_info["stored_bytes"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.phase}-rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    if rank == 0 and args.phase == "resume":
        saved = json.loads((out / "save-rank0.json").read_text())
        for mode in args.modes.split(","):
            ours = sum(p.stat().st_size for p in Path(folder_of(out, mode, args)).iterdir())
            default = sum(p.stat().st_size for p in (out / f"{mode}-default").iterdir())
            keyframes = out / mode / ".ink-keyframes"
            extra = f" + keyframes {sum(p.stat().st_size for p in keyframes.rglob('*.ink'))} B" if args.keyframes else ""
            print(f"{mode}: stored {ours} B{extra} (DCP default {default} B); uninterrupted "
                  f"{saved[mode]['final_loss']:.6f}, resumed {report[mode]['final_loss']:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
