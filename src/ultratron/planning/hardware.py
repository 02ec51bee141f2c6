"""Accelerators the planner knows: dense peak FLOP/s, memory and link bandwidths, each with a source.

Peaks are *dense* tensor-core figures. Vendor datasheets headline the 2:4 structured-sparsity
number, which is twice the dense one; dividing by it halves every MFU (a common bug, see the
Ultra-Scale Playbook, Hugging Face 2025). Memory is the capacity the driver reports (GiB), not the
marketing "GB".
Bandwidths are per GPU and per direction: `intra_node_bw` over NVLink / Infinity Fabric / PCIe,
`inter_node_bw` over the network (one NIC per GPU, as in the reference systems named).

The datasheet figures are ceilings that real kernels do not reach; the planner prices work at what
they do reach (`hbm_bw`, `intra_node_busbw`):
  - memory: kernels stream at `HBM_ACHIEVED` = 0.92 of the datasheet bandwidth (torchao's roofline
    model, torchao/testing/training/roofline_utils.py: large pointwise Triton kernels on an H100);
  - NVLink: NCCL's all-gather and all-reduce on 8 H100 reach a bus bandwidth of 360 GB/s, not the
    datasheet's 450 a direction (NCCL's developers, NVIDIA/nccl-tests issue 326, name 360 GB/s as
    the figure to expect on H100): `NVLINK_ACHIEVED` = 0.8. The other NVSwitch nodes (H200, A100, B200)
    are assumed to reach the same fraction; PCIe, Infinity Fabric and the network have no published
    NCCL figure here and stay at their datasheet rate. `ultratron bench comm` measures a cluster's own.

The CPU has no datasheet peak: the trainer measures its matmul throughput (`training.mfu`), so MFU
on a CPU is relative to what its matmul achieves. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ultratron.errors import UserError

GiB = 1024**3
GB = 1e9
TFLOPS = 1e12
HBM_ACHIEVED = 0.92  # of the datasheet memory bandwidth (module docstring: torchao's roofline model)
NVLINK_ACHIEVED = 360 / 450  # NCCL's bus bandwidth on 8 H100 over the datasheet's (module docstring)


@dataclass(frozen=True)
class Accelerator:
    name: str
    flops: dict[str, float]  # dtype → dense peak FLOP/s
    memory_bytes: float
    intra_node_bw: float  # bytes/s per GPU per direction inside a node
    inter_node_bw: float  # bytes/s per GPU per direction between nodes
    gpus_per_node: int
    source: str
    aliases: tuple[str, ...] = field(default=())
    # One collective's fixed cost (s), inside a node and across: NCCL's small-message times, which
    # no datasheet gives. Assumed typical figures; `ultratron bench comm` measures a cluster's own.
    intra_node_latency: float = 10e-6
    inter_node_latency: float = 30e-6
    memory_bw: float = 3.35e12  # HBM bytes/s (datasheet)
    # fractions of the datasheet's memory and intra-node figures that kernels and NCCL reach (module
    # docstring); 1 for figures that were measured or given as achieved
    memory_achieved: float = HBM_ACHIEVED
    intra_node_achieved: float = 1.0
    # attention at the rates measured on an H200 by sequence (planning.compute); False: at the matmul
    # rate (a measured profile of another device, a CPU, where that table does not apply)
    attention_table: bool = True
    # A device whose ranks share CPU cores (`ultratron bench comm` on a CPU records them): each rank
    # computes at its measured rate ÷ max(1, ranks per node × threads per rank ÷ cores), and its
    # collectives (gloo's threads on the same cores) cannot hide behind its compute. 0: a GPU, its own.
    cores: int = 0
    threads_per_rank: int = 1
    comm_uses_cores: bool = False
    # Measured by `ultratron bench comm` on the model's own shapes (planning.profile.fit_kernels): a
    # kind of non-matmul work ("layer", "loss", "optimizer") → (bytes/s, seconds per call), and
    # attention's FLOP/s. Empty / 0: elementwise work at `memory_bw`, attention as `attention_table` says.
    kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the host link, bytes/s per GPU per direction: PCIe Gen5 x16's 64 GB/s (H100 SXM and PCIe, H200
    # datasheets); activation offload's copies cross it
    host_bw: float = 64 * GB
    # host memory per GPU that offloaded activations may take: a DGX H100's 2 TiB over its 8 GPUs, half
    # of it (the data loader, pinned buffers, the process itself take the rest)
    host_memory_bytes: float = 128 * GiB
    attention_flops: float = 0.0

    @property
    def hbm_bw(self) -> float:
        """The memory bandwidth elementwise kernels and memory-bound matmuls run at, bytes/s."""
        return self.memory_bw * self.memory_achieved

    @property
    def intra_node_busbw(self) -> float:
        """The bus bandwidth NCCL's collectives reach inside a node, bytes/s per GPU per direction."""
        return self.intra_node_bw * self.intra_node_achieved

    def core_share(self, ranks_per_node: int) -> float:
        """How many times slower a rank computes when `ranks_per_node` ranks share the node's cores."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks_per_node * self.threads_per_rank / self.cores)


def _flops(bf16: float, fp32: float, tf32: float, fp8: float | None = None) -> dict[str, float]:
    table = {"bf16": bf16 * TFLOPS, "fp16": bf16 * TFLOPS, "fp32": fp32 * TFLOPS, "tf32": tf32 * TFLOPS}
    if fp8 is not None:
        table["fp8"] = fp8 * TFLOPS
    return table


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 column: BF16 1,979 TFLOPS *with sparsity*
    # → 989.4 dense; TF32 494.7 dense; FP32 67; FP8 1,979 dense. 80 GB HBM3 (nvidia-smi: 81,559 MiB).
    # NVLink 4: 900 GB/s bidirectional → 450 GB/s per direction. DGX H100: 8× ConnectX-7 400 Gb/s.
    "h100-sxm": Accelerator(
        "H100 SXM", _flops(989.4, 67.0, 494.7, 1978.9), 79.6 * GiB, 450 * GB, 50 * GB, 8,
        "NVIDIA H100 datasheet (SXM5): dense BF16 989.4 TFLOP/s, 80 GB HBM3, NVLink 900 GB/s, "
        "DGX H100 400 Gb/s per GPU",
        aliases=("h100", "h100 80gb hbm3", "h100 sxm", "h100-sxm5"), memory_bw=3.35e+12,
        intra_node_achieved=NVLINK_ACHIEVED,
    ),
    # Same datasheet, PCIe column: BF16 1,513 sparse → 756.5 dense; TF32 378; FP32 51; 80 GB HBM2e.
    # No NVSwitch: GPUs talk over PCIe Gen5 x16 (64 GB/s per direction); assume a 200 Gb/s NIC each.
    "h100-pcie": Accelerator(
        "H100 PCIe", _flops(756.5, 51.0, 378.0, 1513.0), 79.6 * GiB, 64 * GB, 25 * GB, 8,
        "NVIDIA H100 datasheet (PCIe): dense BF16 756.5 TFLOP/s, 80 GB HBM2e, PCIe Gen5 64 GB/s",
        aliases=("h100 pcie", "h100-pcie"), memory_bw=2e+12,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column: same compute as H100 SXM, 141 GB
    # HBM3e (nvidia-smi: 143,771 MiB), NVLink 900 GB/s; HGX H200 with 400 Gb/s per GPU.
    "h200": Accelerator(
        "H200 SXM", _flops(989.4, 67.0, 494.7, 1978.9), 140.4 * GiB, 450 * GB, 50 * GB, 8,
        "NVIDIA H200 datasheet (SXM): dense BF16 989.4 TFLOP/s, 141 GB HBM3e, NVLink 900 GB/s",
        aliases=("h200", "h200 sxm", "gh200"), memory_bw=4.8e+12,
        intra_node_achieved=NVLINK_ACHIEVED,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 dense (624 sparse), TF32 156, FP32 19.5.
    # NVLink 3: 600 GB/s bidirectional → 300 per direction; DGX A100: 8× HDR 200 Gb/s.
    "a100-40gb": Accelerator(
        "A100 40GB", _flops(312.0, 19.5, 156.0), 40.0 * GiB, 300 * GB, 25 * GB, 8,
        "NVIDIA A100 datasheet: dense BF16 312 TFLOP/s, 40 GB HBM2, NVLink 600 GB/s, HDR 200 Gb/s",
        aliases=("a100-sxm4-40gb", "a100 40gb", "a100-pcie-40gb"), memory_bw=1.555e+12,
        intra_node_achieved=NVLINK_ACHIEVED,
    ),
    "a100-80gb": Accelerator(
        "A100 80GB", _flops(312.0, 19.5, 156.0), 80.0 * GiB, 300 * GB, 25 * GB, 8,
        "NVIDIA A100 datasheet: dense BF16 312 TFLOP/s, 80 GB HBM2e, NVLink 600 GB/s, HDR 200 Gb/s",
        aliases=("a100", "a100-sxm4-80gb", "a100 80gb", "a100 80gb pcie"), memory_bw=2.039e+12,
        intra_node_achieved=NVLINK_ACHIEVED,
    ),
    # NVIDIA HGX B200 datasheet (2024): FP16/BF16 4.5 PFLOPS with sparsity → 2.25 dense per GPU;
    # TF32 2.2 sparse → 1.1 dense; FP8 9 sparse → 4.5 dense; FP32 600 TFLOPS per 8 GPUs → 75.
    # 180 GB HBM3e; NVLink 5: 1.8 TB/s bidirectional → 900 GB/s; DGX B200: 400 Gb/s per GPU.
    "b200": Accelerator(
        "B200", _flops(2250.0, 75.0, 1100.0, 4500.0), 179.0 * GiB, 900 * GB, 50 * GB, 8,
        "NVIDIA HGX B200 datasheet: dense BF16 2.25 PFLOP/s, 180 GB HBM3e, NVLink 1.8 TB/s",
        aliases=("b200", "hgx b200"), memory_bw=8e+12,
        intra_node_achieved=NVLINK_ACHIEVED,
    ),
    # AMD Instinct MI300X datasheet (2023): BF16 1,307.4 dense (2,614.9 sparse), TF32 653.7,
    # FP32 163.4, FP8 2,614.9 dense; 192 GB HBM3; 7 Infinity Fabric links × 64 GB/s = 448 GB/s per
    # direction to the other 7 GPUs; assume one 400 Gb/s NIC per GPU.
    "mi300x": Accelerator(
        "MI300X", _flops(1307.4, 163.4, 653.7, 2614.9), 192.0 * GiB, 448 * GB, 50 * GB, 8,
        "AMD Instinct MI300X datasheet: dense BF16 1307.4 TFLOP/s, 192 GB HBM3, Infinity Fabric 896 GB/s",
        aliases=("mi300x", "amd instinct mi300x", "instinct mi300x"), memory_bw=5.3e+12,
    ),
    # NVIDIA L40S datasheet (2023): BF16 733 with sparsity → 362.05 dense; TF32 183; FP32 91.6;
    # 48 GB GDDR6 (nvidia-smi: 46,068 MiB); no NVLink: PCIe Gen4 x16 32 GB/s; assume 200 Gb/s NIC.
    "l40s": Accelerator(
        "L40S", _flops(362.05, 91.6, 183.0, 733.0), 45.0 * GiB, 32 * GB, 25 * GB, 8,
        "NVIDIA L40S datasheet: dense BF16 362 TFLOP/s, 48 GB GDDR6, PCIe Gen4 32 GB/s",
        aliases=("l40s",), memory_bw=8.64e+11,
    ),
}

DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                 "float8": "fp8"}


def _normalise(name: str) -> str:
    return " ".join(name.lower().replace("nvidia", "").replace("_", " ").split())


def find_accelerator(name: str) -> Accelerator | None:
    """The table entry for a key ("h100-sxm") or a device name as torch reports it ("NVIDIA H100 PCIe")."""
    key = _normalise(name)
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    for acc in ACCELERATORS.values():
        if key in acc.aliases or key == acc.name.lower():
            return acc
    # Device strings carry extra words ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"): match by part.
    if "h100" in key:
        return ACCELERATORS["h100-pcie" if "pcie" in key else "h100-sxm"]
    if "h200" in key:
        return ACCELERATORS["h200"]
    if "a100" in key:
        return ACCELERATORS["a100-40gb" if "40gb" in key else "a100-80gb"]
    for short in ("b200", "mi300x", "l40s"):
        if short in key:
            return ACCELERATORS[short]
    return None


def get_accelerator(name: str) -> Accelerator:
    """Like `find_accelerator`, but raise a UserError naming the known ones."""
    acc = find_accelerator(name)
    if acc is None:
        raise UserError(f"unknown GPU {name!r}; known: {', '.join(ACCELERATORS)}")
    return acc


def dtype_key(dtype: str) -> str:
    key = dtype.lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(key, key)


def peak_flops(device_name: str, dtype: str) -> tuple[float, str]:
    """(dense peak FLOP/s, where the number comes from) for a GPU name and dtype, looked up in
    `ACCELERATORS` (matching torch's device names such as "NVIDIA H100 80GB HBM3"). An unknown
    device or dtype gives 0.0, which `flops.mfu` turns into an MFU of 0 rather than a wrong number.
    A CPU has no table entry: the trainer measures it (`training.mfu`)."""
    key = dtype_key(dtype)
    acc = find_accelerator(device_name)
    if acc is None:
        return 0.0, f"unknown device {device_name!r} (known: {', '.join(ACCELERATORS)})"
    if key not in acc.flops:
        return 0.0, f"no {dtype!r} peak for {acc.name} in the table"
    return acc.flops[key], f"{acc.name} dense {key}: {acc.source}"
