"""`gpt3d`: the embedded parallel trainer (dp × cp × pp × tp, ep for MoE, ZeRO via FSDP2), a plugin.

Every rank builds the model on the meta device, keeps only its pipeline stage(s), applies
its tensor/expert/context/data-parallel sharding, and only then allocates and initialises
its own shards (init.py: values are a function of seed, name and row, so any layout starts
from the same weights and a parallel run matches a single process to float rounding;
`init="full"` builds the whole model on the host first, as before, for comparison). The
step is forward/backward over `microbatches` chunks of the local batch (gradient
accumulation) without pipeline parallelism and a `torch.distributed.pipelining` schedule
with it; the loss is the mean over all tokens of the global batch either way. Under context
parallelism each rank takes its two chunks of every sequence (context.py).
`state_dict()` is sharded and DCP-compatible (model and flattened optimizer state through
`torch.distributed.checkpoint.state_dict`, plus step, data position and RNG), so a checkpoint
saved under one mesh loads under another.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from unbroken.trainer import context, init, keeptrainer, optimstate, parallel
from unbroken.trainer.config import OptimConfig, TrainConfig
from unbroken.trainer.data import TextLoader, load_corpus
from unbroken.trainer.model import Transformer, cross_entropy, moe_layers
from unbroken.trainer.plugin import GroupValue
from unbroken.trainer.rtrace import mark

log = structlog.get_logger(__name__)

_SAVE_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
_LOAD_OPTS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def lr_at(step: int, o: OptimConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` over `decay_steps`."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    t = min(1.0, (step - o.warmup_steps) / o.decay_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))


def _clean_fqn(name: str) -> str:
    """A parameter name as DCP writes it: without wrapper modules' prefixes."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _on_cpu(c: TrainConfig | None) -> TrainConfig | None:
    """`c` with its device "cpu" when it runs on the CPU ("auto" without a GPU too)."""
    return dataclasses.replace(c, device="cpu") if c is not None and not c.uses_cuda() else c


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this GPU from the planner's datasheet table, None on CPU/unknown."""
    if device.type != "cuda":
        return None
    try:
        from unbroken.trainer.plan import GPUS
    except ImportError:
        return None
    name = "".join(c for c in torch.cuda.get_device_name(device).lower() if c.isalnum())
    for key, spec in GPUS.items():
        if key.split("-")[0] in name:
            return float(spec.peak_tflops) * 1e12
    return None


class GPT3DTrainer:
    """The embedded engine. Construct, then `setup(config)` on every rank."""

    def __init__(self) -> None:
        self.config: TrainConfig | None = None
        self.step = 0
        self._owns_pg = False
        self.state_version = 0  # bumped whenever the state's tensors may be replaced
        # set by the run loop before a world's first step: its phases are marked (rtrace)
        self.trace_step = False
        # set before `setup` when a restore follows: the parameters are allocated, not
        # filled (`uninitialized`), and `init_weights` fills them if nothing was restored
        self.defer_init = False
        self.uninitialized = False
        # (flat optimizer key, param group, group key) of every param-group value
        self._groups: list[tuple[str, dict[str, Any], str]] | None = None
        self._shared: list[GroupValue] | None = None  # `_groups` by group and key
        self._unmapped = -1  # the state_version whose param groups did not map
        self.slow_factor = 1.0  # an injected slowdown of this rank's compute (drills)
        # called as the step's timed collective begins (the hooks' "collective" phase)
        self.on_collective: Callable[[], object] | None = None
        # (rank, world size, group counter) it was set up in, and its groups' ranks as it
        # left a world (trainer/keeptrainer.py: kept across an in-job recovery)
        self._place: tuple[int, int, int] = (-1, -1, -1)
        self._left_groups: dict[str, tuple[int, ...]] | None = None
        # On a GPU, the next batch drawn and copied to the device at the end of a step:
        # (the loader's draw it came from, the loader's position before it, inputs, targets)
        self._prefetched: tuple[Any, dict[str, Any], torch.Tensor, torch.Tensor] | None = None
        # draw the next batch at the end of a step: None on a GPU only (what it is for),
        # True everywhere (tests), False never
        self.prefetch_batches: bool | None = None

    # ---- setup -------------------------------------------------------------------------
    def setup(self, config: TrainConfig) -> None:
        """Build mesh, model stages, optimizers and the data loader for this rank.

        Raises:
            ValueError: the layout does not match the world size.
        """
        if not dist.is_initialized():
            # One process without a launcher: a private single-rank group.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._owns_pg = True
        world = dist.get_world_size()
        config.check_world(world)
        self.config = c = config
        p = c.parallel
        use_cuda = c.uses_cuda()
        if use_cuda:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        bf16 = c.dtype == "bf16" or (c.dtype == "auto" and use_cuda)
        # the group counter its meshes' names start from (a kept trainer's rejoin checks it)
        self._place = (dist.get_rank(), world, dist.distributed_c10d._world.group_count)
        self.topo = parallel.build_mesh(p, self.device.type)
        self.log = log.bind(rank=dist.get_rank(), dp=self.topo.dp_rank, pp=self.topo.pp_rank)
        self._bf16 = bf16
        self._build(c, bf16)

    def _build(self, c: TrainConfig, bf16: bool) -> None:
        """Everything of `setup` on the meshes it made (no group is made here)."""
        p = c.parallel
        self._build_parts(c, bf16)
        self.experts = [prm for part in self.parts for prm in parallel.expert_params(part)]
        self.moes = [m for part in self.parts for m in moe_layers(part)]
        if p.dp > 1 and p.dp_mode != "zero2" and not parallel.reshards_after_forward(p):
            self.log.warning(
                "ZBV keeps parameters unsharded from forward to backward (ZeRO-2-like memory)",
                dp_mode=p.dp_mode,
            )
        self.optimizers = [self._optimizer(part, c.optim) for part in self.parts]
        self.state_version += 1
        self._groups = self._shared = None

        self._prefetched = None
        self.loader = TextLoader(
            load_corpus(c.data.path, c.data.max_corpus_bytes),
            seq_len=c.data.seq_len,
            global_batch=c.step_batch,
            dp_rank=self.topo.dp_rank,
            dp_size=self.topo.dp_size,
            seed=c.data.seed,
        )
        self.schedule: Any = None
        self.timer: parallel.StageTimer | None = None
        if p.pp > 1:
            self.schedule, self.stages, self.timer = parallel.build_schedule(
                self.parts, self.stage_ids, p, self.topo, self.device, cross_entropy
            )
        n_stages = p.pp * p.stages_per_rank
        self.has_first = 0 in self.stage_ids
        self.has_last = (n_stages - 1) in self.stage_ids
        self._flops_per_token = c.model.flops_per_token(c.data.seq_len)
        self._peak = _peak_flops(self.device)
        self.log.info(
            "trainer set up",
            layout=f"dp{p.dp}×cp{p.cp}×pp{p.pp}×tp{p.tp}" + (f" (ep{p.ep})" if p.ep > 1 else ""),
            init=c.init,
            init_s=round(self.init_s, 3),
            schedule=p.schedule if p.pp > 1 else None,
            stages=self.stage_ids,
            params=c.model.n_params(),
            device=str(self.device),
        )

    def _build_parts(self, c: TrainConfig, bf16: bool) -> None:
        """This rank's model stages, parallelized as `c.parallel` says (and materialized
        from the meta device when `c.init` is "meta"); sets `parts`, `stage_ids`, `init_s`."""
        p = c.parallel
        t_init = time.perf_counter()
        torch.manual_seed(c.seed)
        meta = c.init == "meta"
        with torch.device("meta" if meta else self.device):
            full = Transformer(c.model, seed=c.seed)
        full.set_activation_checkpointing(p.activation_checkpointing, p.ac_every)
        if p.pp > 1:
            self.stage_ids = parallel.stage_ids(p, self.topo.pp_rank)
            n_stages = p.pp * p.stages_per_rank
            parts = [parallel.cut_stage(full, s, n_stages) for s in self.stage_ids]
            del full
        else:
            self.stage_ids, parts = [0], [full]
        self.parts: list[Transformer] = parts
        for part in self.parts:
            if p.tp > 1:
                parallel.apply_tp(part, self.topo.mesh["tp"], p.sequence_parallel)
            if p.ep > 1:
                parallel.apply_ep(part, self.topo)
            if p.cp > 1:
                parallel.apply_cp(part, self.topo)
            if p.compile:
                for block in parallel.blocks(part):
                    block.compile()
            if p.dp > 1 or p.cp > 1 or bf16:
                parallel.apply_fsdp(part, self.topo, p, torch.bfloat16 if bf16 else None)
            if meta:
                init.materialize(part, self.device, values=not self.defer_init)
        self.uninitialized = meta and self.defer_init
        self.init_s = time.perf_counter() - t_init

    def init_weights(self) -> None:
        """The initial weights of a model set up with `defer_init` (nothing was restored)."""
        for part in self.parts:
            part.reset_parameters()
        self.uninitialized = False

    @staticmethod
    def _optimizer(part: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
        """AdamW with decay on matrices only; `o.impl` picks the kernels (fused and foreach
        run on CPU and CUDA in torch 2.13; for-loop is the per-parameter reference)."""
        decay = [p for p in part.parameters() if p.dim() >= 2]
        no_decay = [p for p in part.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            foreach=o.impl == "foreach",
            fused=True if o.impl == "fused" else None,
        )

    def device_mesh(self) -> DeviceMesh:
        """This rank's 6-D mesh (`plugin.Meshed`: flash copies record its shape)."""
        return self.topo.mesh

    def stages_per_rank(self) -> int:
        """Pipeline stages this rank holds (`plugin.Meshed`)."""
        assert self.config is not None, "set up"
        return self.config.parallel.stages_per_rank

    # ---- training ----------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters across its stages."""
        return [prm for part in self.parts for prm in part.parameters()]

    def skip(self, n_batches: int) -> None:
        """Skip `n_batches` global batches of data (loss-spike recovery)."""
        self._drop_prefetch()
        self.loader.skip(n_batches)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's batch on the device: the one prefetched at the end of the last step,
        unless the loader's draw was replaced since (a loss-spike drill poisons it), else
        drawn now."""
        pre = self._prefetched
        if pre is not None and pre[0] == self.loader.next_batch:
            self._prefetched = None
            return pre[2], pre[3]
        self._drop_prefetch()  # a prefetched batch is drawn again, through the new draw
        inputs, targets = self.loader.next_batch()
        return inputs.to(self.device), targets.to(self.device)

    def _prefetch(self) -> None:
        """Draw the next batch at the end of this step; on a GPU, start its copy now.

        A step that copies its batch at its start from pageable memory waits, on the host,
        for that copy; and when a flash save's device-to-host copy of the state was enqueued
        just before, it waits for that one too (measured on an H200 with the 125m preset:
        19 ms a step, the length of the 1 GB copy). Copied here, from pinned memory without
        waiting, the batch goes ahead of the save's copy, and the next step launches at once.
        The loader's position stays the one before this batch (`_data_state`), so a
        checkpoint of this step resumes with it. On a CPU only the draw would move, so it
        is off there unless `prefetch_batches` is True (as tests/integration/
        test_batch_prefetch.py sets it).
        """
        on = self.device.type == "cuda" if self.prefetch_batches is None else self.prefetch_batches
        if not on:
            return
        before = self.loader.state_dict()
        draw = self.loader.next_batch
        inputs, targets = draw()
        if self.device.type == "cuda":
            inputs = inputs.pin_memory().to(self.device, non_blocking=True)
            targets = targets.pin_memory().to(self.device, non_blocking=True)
        else:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
        self._prefetched = (draw, before, inputs, targets)

    def _drop_prefetch(self) -> None:
        """Forget a prefetched batch and put the loader back before it."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None:
            self.loader.load_state_dict(pre[1])

    def _data_state(self) -> dict[str, Any]:
        """The loader's position as of the last step (before a prefetched batch)."""
        return self._prefetched[1] if self._prefetched is not None else self.loader.state_dict()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over one global batch; returns the step's metrics."""
        assert self.config is not None, "call setup() first"
        c = self.config
        t0 = time.perf_counter()
        lr = lr_at(self.step, c.optim) * c.lr_scale
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
        td = time.perf_counter()
        inputs, targets = self._batch()
        data_s = time.perf_counter() - td  # waiting for data (goodput's data loading)
        cp, cp_rank = c.parallel.cp, self.topo.cp_rank
        inputs, targets = context.split(inputs, cp, cp_rank), context.split(targets, cp, cp_rank)

        idle: float | None = None
        # Straggler telemetry: what this rank waited for its peers (pipeline idle, the
        # final all-reduce) is not compute. Waits inside FSDP's collectives are not timed.
        pipe_wait = 0.0
        self._trace("s_batch")
        if self.schedule is None:
            loss = self._accumulate(inputs, targets, c.parallel.microbatches)
        else:
            loss, idle, pipe_wait = self._pipeline_step(inputs, targets)
        self._trace("s_fwd_bwd")
        if self.experts:
            parallel.sync_expert_grads(self.experts, self.topo, c.parallel)
        pp_group = self.topo.pp_group if c.parallel.pp > 1 else None
        grad_norm = parallel.clip_grad_norm(
            self.parameters(), c.optim.max_grad_norm, pp_group, self.device
        )
        for opt in self.optimizers:
            opt.step()
        self._trace("s_optim")

        # Every (dp, tp) coordinate holds the last stage once; average their losses.
        loss_sum = loss.detach().float().reshape(1).clone()
        if self.slow_factor > 1.0:
            # an injected slowdown is spent just before the one timed all-reduce, so the
            # peers' wait for it lands where it is measured
            time.sleep((self.slow_factor - 1.0) * max(0.0, time.perf_counter() - t0 - pipe_wait))
        tw = time.perf_counter()
        if dist.get_world_size() > 1:
            if self.on_collective is not None:
                self.on_collective()
            if not self.has_last:
                loss_sum.zero_()
            dist.all_reduce(loss_sum)
        wait = pipe_wait + time.perf_counter() - tw
        self._trace("s_reduced")
        self.trace_step = False
        mean_loss = float(loss_sum) / (c.parallel.dp * c.parallel.cp * c.parallel.tp)
        self.step += 1
        td = time.perf_counter()
        self._prefetch()
        data_s += time.perf_counter() - td
        dt = time.perf_counter() - t0
        tokens = c.step_batch * c.data.seq_len
        flops_per_s = self._flops_per_token * tokens / dt
        mfu = None
        if self._peak is not None:
            mfu = flops_per_s / (self._peak * dist.get_world_size())
        return {
            "step": self.step,
            "loss": mean_loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            "compute_s": max(0.0, dt - wait),
            "collective_wait_s": wait,
            "data_s": data_s,
            "flops_per_s": flops_per_s,
            "mfu": mfu,
            "pipeline_idle_fraction": idle,
        }

    def _pipeline_step(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, float, float]:
        """Forward and backward through the pipeline schedule: the loss (zero off the last
        stage), the fraction of the schedule this rank idled, and those seconds."""
        assert self.timer is not None and self.schedule is not None
        self.timer.busy_s = 0.0
        ts = time.perf_counter()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.has_last:
            kwargs = {"target": targets, "losses": losses}
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, **kwargs)
        idle = max(0.0, 1.0 - self.timer.busy_s / (time.perf_counter() - ts))
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        return loss, idle, idle * (time.perf_counter() - ts)

    def _trace(self, phase: str) -> None:
        """Mark a phase of a world's first step (after the device's work so far)."""
        if self.trace_step:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            mark(phase, cpu_s=round(time.process_time(), 4))  # which rank computed, which waited

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, m: int) -> torch.Tensor:
        """Forward/backward over `m` equal chunks of the local batch, gradients summed with
        each chunk's loss scaled by 1/m (so the step sees the mean over all its tokens).

        FSDP reduce-scatters gradients only after the last chunk.
        """
        model = self.parts[0]
        for moe in self.moes:
            moe.aux_scale = 1.0 / m
        total = torch.zeros((), device=self.device)
        fsdp = hasattr(model, "set_requires_gradient_sync")
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m), strict=True)):
            if fsdp:
                model.set_requires_gradient_sync(i == m - 1)  # type: ignore[operator]
            loss = cross_entropy(model(x), y)
            (loss / m).backward()
            total += loss.detach() / m
        return total

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sharded state: model and optimizer as DTensors/FQN-keyed tensors, plus counters.

        Every stage keeps global parameter names, so dicts from different pp ranks do not
        collide and DCP reshards between layouts.
        """
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            model.update(get_model_state_dict(part, options=_SAVE_OPTS))
            optimstate.create_adam_state(opt)  # not torch's zero step (trainer/optimstate.py)
            optim.update(get_optimizer_state_dict(part, opt, options=_SAVE_OPTS))
        return {
            "model": model,
            "optimizer": optim,
            "step": self.step,
            "data": self._data_state(),
            "rng": torch.get_rng_state(),
        }

    # ---- cheap per-step snapshots (plugin.Snapshots) ---------------------------------------
    def snapshot_key(self) -> Any:
        """Changes when a state tensor may be new: a load, a setup, optimizer state created.

        None (full path) when the param-group values cannot be mapped to DCP's keys.
        """
        if self._groups is None:
            if self._unmapped == self.state_version or not self._map_groups():
                self._unmapped = self.state_version  # tried for this state: full path
                return None
        return (self.state_version, tuple(len(o.state) for o in self.optimizers))

    def snapshot_fresh(self) -> dict[str, Any]:
        """What changes per step: the learning rate (param groups), step, data, RNG."""
        assert self._groups is not None, "snapshot_key() first"
        rest, _ = self.snapshot_fresh_shared()
        return {"optimizer": {key: group[k] for key, group, k in self._groups}, **rest}

    def snapshot_fresh_shared(self) -> tuple[dict[str, Any], list[GroupValue]]:
        """`snapshot_fresh()` with the param-group values by group (plugin.SharedSnapshots):
        one entry per group and key, not one per parameter."""
        assert self._shared is not None, "snapshot_key() first"
        rest = {"step": self.step, "data": self._data_state(), "rng": torch.get_rng_state()}
        return rest, self._shared

    def _map_groups(self) -> bool:
        """Map DCP's flattened `param_groups.<fqn>.<key>` entries to the live param groups,
        checked once against DCP's own optimizer state dict."""
        groups: list[tuple[str, dict[str, Any], str]] = []
        dcp: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            names = {id(prm): _clean_fqn(n) for n, prm in part.named_parameters()}
            for group in opt.param_groups:
                for prm in group["params"]:
                    fqn = names.get(id(prm))
                    if fqn is None:
                        return False
                    groups.extend(
                        (f"param_groups.{fqn}.{k}", group, k) for k in group if k != "params"
                    )
            optimstate.create_adam_state(opt)
            dcp.update(get_optimizer_state_dict(part, opt, options=_SAVE_OPTS))
        want = {k: v for k, v in dcp.items() if k.startswith("param_groups.")}
        mine = {key: group[k] for key, group, k in groups}
        if set(mine) != set(want) or any(repr(mine[k]) != repr(want[k]) for k in want):
            self.log.warning(
                "flash snapshot disabled: param groups do not map to DCP's keys",
                missing=sorted(set(want) - set(mine))[:3],
                extra=sorted(set(mine) - set(want))[:3],
            )
            return False
        self._groups = groups
        by: dict[tuple[int, str], tuple[dict[str, Any], str, list[str]]] = {}
        for key, group, k in groups:
            by.setdefault((id(group), k), (group, k, []))[2].append(key)
        self._shared = [(group, k, tuple(keys)) for group, k, keys in by.values()]
        return True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore model, optimizer, step, data position and RNG (strict=False across stages)."""
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_model_state_dict(part, state_dict["model"], options=_LOAD_OPTS)
            set_optimizer_state_dict(part, opt, state_dict["optimizer"], options=_LOAD_OPTS)
        self.step = int(state_dict["step"])
        self._prefetched = None
        self.loader.load_state_dict(state_dict["data"])
        torch.set_rng_state(state_dict["rng"].cpu())
        self.state_version += 1
        self._groups = self._shared = None
        self.log.info("trainer state loaded", step=self.step)

    # ---- kept across an in-job recovery (trainer/keeptrainer.py) ----------------------
    def _meshes(self) -> list[DeviceMesh]:
        t = self.topo
        return [m for m in (t.mesh, t.fsdp_mesh, t.expert_replicas) if m is not None]

    def leave_world(self) -> str | None:
        """Reset what a failed step left half done (FSDP2's `reset_iter_state`), drop the
        gradients and note the groups' ranks; None: the trainer can be kept."""
        p = self.config.parallel if self.config is not None else None
        if p is None or not self.parts:
            return "not set up"
        if p.cp > 1 or p.ep > 1 or p.compile or self._owns_pg:
            return "context or expert parallelism, or compilation hold groups"
        if self.device.type != "cpu":  # an aborted NCCL step's events: not tried on a GPU yet
            return f"not kept on {self.device.type} yet"
        from torch.distributed.fsdp import FSDPModule

        self._left_groups = None
        for part in self.parts:
            if isinstance(part, FSDPModule):
                part.reset_iter_state()  # the root: every group of the part
                if p.pp > 1:  # as pipelining leaves them after a whole step (its last
                    part.set_is_last_backward(True)  # reduction), not a failed one
                    part.set_reshard_after_backward(True)
                    part.set_requires_gradient_sync(True)
        # pipelining's stages hold the old pp group and the failed step's buffers: made
        # again on the kept parts in the next world (`rejoin_world`), as a new trainer's are
        self.schedule, self.stages, self.timer = None, [], None
        keeptrainer.drop_step_grads(self.parts)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self._prefetched = None
        self._left_groups = keeptrainer.group_ranks(self._meshes())
        return None

    def start_afresh(self) -> None:
        """Nothing was restored into this kept trainer: become what a new one is before its
        first step (model, optimizer, loader built again, weights left to `init_weights`),
        on the meshes it has: its peers made their groups once."""
        assert self.config is not None, "set up"
        self.defer_init, self.step = True, 0
        self._build(self.config, self._bf16)

    def rejoin_world(self, config: TrainConfig) -> str | None:
        """Make this layout's groups in the new world and point the kept meshes and FSDP2
        at them; None when done, else why not (before any group is made)."""
        if self._left_groups is None:
            return "left no world"
        if _on_cpu(config) != _on_cpu(self.config):  # a standby's dry run says "cpu"
            return "another configuration"
        place = (dist.get_rank(), dist.get_world_size(), dist.distributed_c10d._world.group_count)
        if place != self._place:  # the counter too: other names, and no group made yet
            return f"another place: rank, world size, groups before {place} (was {self._place})"
        assert self.config is not None
        p = self.config.parallel
        parallel.build_mesh(p, self.device.type)  # the same groups, made
        keeptrainer.repoint(self._meshes(), self.parts, self._left_groups)
        self._left_groups = None
        if p.pp > 1:  # new stages on the kept parts: the first step infers their shapes
            self.schedule, self.stages, self.timer = parallel.build_schedule(  # as a new
                self.parts, self.stage_ids, p, self.topo, self.device, cross_entropy
            )  # trainer's do (and its peers' stages, new or kept, exchange them alike)
        self.state_version += 1  # its tensors are restored into next
        return None

    def close(self) -> None:
        """Drop the schedule, stages and optimizers; destroy the group only if we made it."""
        self.schedule = None
        self.stages = []
        self.parts = []
        self.optimizers = []
        self._prefetched = None
        gc.collect()
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False
