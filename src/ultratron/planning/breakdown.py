"""A rank's bytes, term by term (`MemoryBreakdown`): what `planning.memory` estimates for a training
step and for the start before it (`planning.start`), and the moments the terms add up to — backward's
peak, the optimizer step's, the start's — and which of them a layout must fit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

GiB = 1024**3


@dataclass
class MemoryBreakdown:
    """Bytes on the heaviest GPU (the first or last pipeline stage), term by term."""

    parameters: float
    gradients: float
    grad_accum_buffer: float
    master_weights: float
    optimizer_states: float
    activations: float
    loss_logits: float  # the fp32 log-probabilities kept for the cross-entropy backward
    comm_buffers: float
    transient: float  # what backward briefly holds at its peak on top of the above (see the module doc)
    stage: str  # "only", or the pipeline rank's stages: "first", "last", "first+last" or "middle"
    extra: dict = field(default_factory=dict)
    # of `gradients`, those alive at backward's peak: all of DDP's (its buckets stay), none of FSDP2's
    # (made by the last micro-batch's reduce-scatter), one process's only once an earlier micro-batch made them
    backward_gradients: float | None = None  # None: all of `gradients`
    step_temporaries: float = 0.0  # the optimizer step's (or DDP's bucket rebuild's), no activations alive
    # FSDP2's last reduce-scatter frees the unsharded accumulation as it makes the sharded gradients;
    # Megatron-LM's fp32 main gradients are what the step reads
    accum_at_step: bool = True
    # offload_activations: the blocks' saved activations on the host (pinned CPU memory), not on the GPU;
    # not one of TERMS (device bytes)
    host_activations: float = 0.0
    # From `meta` to the first step (the module doc's "Start"), on the rank whose start is the largest
    # (extra["start_pp_rank"]); not in TERMS, which are the step's
    start_shards: float = 0.0  # the rank's parameter shards at rest (fp32)
    start_buffers: float = 0.0  # its buffers: the rope tables
    start_init_transient: float = 0.0  # initialization: two blocks of its largest (models/init_blocks.py)
    start_load_transient: float = 0.0  # a load: the largest stored chunk it reads whole, fp32

    TERMS = ("parameters", "gradients", "grad_accum_buffer", "master_weights", "optimizer_states",
             "activations", "loss_logits", "comm_buffers", "transient")

    @property
    def static_bytes(self) -> float:
        return (self.parameters + self.gradients + self.grad_accum_buffer + self.master_weights
                + self.optimizer_states)

    @property
    def backward_bytes(self) -> float:
        """Backward's peak: every term, less the gradients not made yet."""
        absent = 0.0 if self.backward_gradients is None else self.gradients - self.backward_gradients
        return sum(getattr(self, term) for term in self.TERMS) - absent

    @property
    def step_bytes(self) -> float:
        """The optimizer step: the static terms, every gradient made, the buffers and the step's temporaries."""
        accum = 0.0 if self.accum_at_step else self.grad_accum_buffer
        return self.static_bytes - accum + self.comm_buffers + self.step_temporaries

    @property
    def peak_moment(self) -> str:
        return "step" if self.step_bytes > self.backward_bytes else "backward"

    @property
    def peak_bytes(self) -> float:
        return max(self.backward_bytes, self.step_bytes)

    @property
    def start_init_bytes(self) -> float:
        """A fresh start: the shards and buffers, and initialization's two blocks."""
        return self.start_shards + self.start_buffers + self.start_init_transient

    @property
    def start_load_bytes(self) -> float:
        """A start from a checkpoint: the shards and buffers, and the largest stored chunk read whole."""
        return self.start_shards + self.start_buffers + self.start_load_transient

    @property
    def start_bytes(self) -> float:
        """The start's peak, fresh or from a checkpoint (a run may do both: it starts, later resumes)."""
        return max(self.start_init_bytes, self.start_load_bytes)

    @property
    def fit_bytes(self) -> float:
        """What the GPU must hold at some moment: the larger of the step's peak and the start's."""
        return max(self.peak_bytes, self.start_bytes)

    @property
    def fit_moment(self) -> str:
        """Which moment `fit_bytes` is: "step", "init" (a fresh start) or "load" (a start from a checkpoint)."""
        if self.peak_bytes >= self.start_bytes:
            return "step"
        return "load" if self.start_load_bytes >= self.start_init_bytes else "init"

    def fit_description(self) -> str:
        """`fit_bytes` in words, naming the start when it is the larger: what a refusal says."""
        need = f"{self.fit_bytes / GiB:.1f} GiB"
        if self.fit_moment == "step":
            return need
        held = (self.start_shards + self.start_buffers) / GiB
        if self.fit_moment == "load":
            return (f"{need} at its start from a checkpoint ({held:.1f} GiB of shards and buffers + the largest "
                    f"stored tensor it reads whole, {self.start_load_transient / GiB:.1f} GiB in fp32), more than "
                    f"the step's peak of {self.peak_bytes / GiB:.1f} GiB")
        return (f"{need} at its start ({held:.1f} GiB of shards and buffers + two initialization blocks, "
                f"{self.start_init_transient / GiB:.2f} GiB), more than the step's peak of "
                f"{self.peak_bytes / GiB:.1f} GiB")

    @property
    def loss_share_bytes(self) -> float:
        """The loss's share of the peak: what the peak would lose if the loss cost nothing — its kept
        log-probabilities, and what its backward holds beyond the blocks' backward (0 where the loss's
        backward is not the largest transient, or the optimizer step is the peak)."""
        without = replace(self, loss_logits=0.0, transient=self.extra.get("transient_without_loss", self.transient))
        return self.peak_bytes - without.peak_bytes

    def as_dict(self) -> dict:
        out = asdict(self)
        out["static_bytes"] = self.static_bytes
        out["backward_bytes"] = self.backward_bytes
        out["step_bytes"] = self.step_bytes
        out["peak_moment"] = self.peak_moment
        out["peak_bytes"] = self.peak_bytes
        out["loss_share_bytes"] = self.loss_share_bytes
        out["start_init_bytes"] = self.start_init_bytes
        out["start_load_bytes"] = self.start_load_bytes
        out["start_bytes"] = self.start_bytes
        out["fit_bytes"] = self.fit_bytes
        out["fit_moment"] = self.fit_moment
        return out
