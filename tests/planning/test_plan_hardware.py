
import pytest

from ultratron.errors import UserError
from ultratron.planning.hardware import ACCELERATORS, get_accelerator, peak_flops


def test_dense_not_sparse_peaks():
    # The sparse headline figures are exactly twice these; MFU against them would halve.
    assert peak_flops("h100-sxm", "bf16")[0] == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")[0] == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16")[0] == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16")[0] == pytest.approx(312e12)
    assert peak_flops("AMD Instinct MI300X", "bf16")[0] == pytest.approx(1307.4e12)
    assert peak_flops("NVIDIA B200", "bf16")[0] == pytest.approx(2250e12)
    assert peak_flops("NVIDIA L40S", "bf16")[0] == pytest.approx(362.05e12)
    assert peak_flops("NVIDIA H200", "fp32")[0] == pytest.approx(67e12)


def test_every_entry_has_the_asked_fields():
    assert set(ACCELERATORS) == {"h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "b200", "mi300x",
                                 "l40s"}
    for acc in ACCELERATORS.values():
        assert acc.flops["bf16"] > acc.flops["fp32"] > 0
        assert acc.intra_node_bw > acc.inter_node_bw > 0
        assert "datasheet" in acc.source
    assert get_accelerator("A100 80GB PCIe").memory_bytes == 80 * 1024**3
    assert get_accelerator("a100-sxm4-40gb").memory_bytes == 40 * 1024**3


def test_unknown_device_gives_zero_with_reason():
    value, source = peak_flops("Voodoo2", "bf16")
    assert value == 0.0 and "unknown device" in source
    with pytest.raises(UserError, match="known: h100-sxm"):
        get_accelerator("Voodoo2")


def test_links_and_memory_are_priced_at_what_nccl_and_kernels_reach():
    from ultratron.cli import build_parser
    from ultratron.cli.plan import resolve_hardware

    h100 = get_accelerator("h100-sxm")
    # NCCL's bus bandwidth on 8 H100 is 360 GB/s of NVLink's 450; kernels stream at 0.92 of HBM's 3.35 TB/s
    assert h100.intra_node_busbw == pytest.approx(360e9) and h100.hbm_bw == pytest.approx(0.92 * 3.35e12)
    assert get_accelerator("h200").intra_node_busbw == pytest.approx(360e9)
    # PCIe and Infinity Fabric nodes have no published NCCL figure: their datasheet rate
    assert get_accelerator("h100-pcie").intra_node_busbw == 64e9
    assert get_accelerator("mi300x").intra_node_busbw == 448e9

    def hardware(*flags):  # `plan estimate`'s own parser
        args = build_parser("plan").parse_args(["plan", "estimate", "--model", "llama3-8b", *flags])
        return resolve_hardware(args)[0]

    # a figure given on the command line is what the links and kernels reach: no fraction on top
    given = hardware("--nvlink-gbs", "300", "--hbm-gbs", "3000")
    assert given.intra_node_busbw == pytest.approx(300e9) and given.hbm_bw == pytest.approx(3000e9)
    assert hardware().intra_node_busbw == pytest.approx(360e9)
