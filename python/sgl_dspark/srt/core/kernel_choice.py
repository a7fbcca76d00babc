"""Which implementation each op family uses: `--kernel-backend {torch,triton}` plus optional
per-family overrides (`--kernel-backend-overrides moe=torch,rope=triton`), and the FP8 paths the
model runner resolved from `--fp8-activations` (the activation format of the W8A8 GEMMs, and
whether the routed experts take the MX path).

Layers resolve their callables from this record once, when they are built: the path
a deployment runs is visible in its command line, never chosen by tensor device or env var.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_dspark.kernels.fp8.reference import Fp8ActFormat

KERNEL_BACKENDS = ("torch", "triton")
# Op families that have a Triton implementation wired into the runtime.
KERNEL_FAMILIES = (
    "rope",
    "mhc",
    "moe",
    "sampling",
    "spec",
    "indexer",
    "norm",
    "linear",
    "engram",
)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    backend: str = "torch"
    overrides: tuple[tuple[str, str], ...] = ()
    # FP8 activations for GEMMs on FP8 weights above decode sizes (None: off; `srt/layers/
    # fp8_linear.py`): the checkpoint's activation quantisation (group, power-of-two scales).
    fp8_activations: Fp8ActFormat | None = None
    # Routed MXFP4 experts through `tl.dot_scaled` with MXFP8 activations (targets that execute
    # it natively, with FP8 activations on): the rows per expert block of the MoE sort at which
    # the target's scaled MMA is native (`kernels/fp8/targets.py::mx_dot_rows`); 0 = off.
    mx_moe_block: int = 0
    # `--enable-deterministic-inference`: every op of the families picks one kernel shape for
    # every batch size, so a row's bits never depend on M or on the other rows (the linear
    # layers through the 16-row-block kernels at any M, the MoE through the sorted grouped
    # path with 16-row expert blocks, the attention without batch-dependent key splits).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"--kernel-backend {self.backend!r}: choose from {KERNEL_BACKENDS}")
        for fam, impl in self.overrides:
            if fam not in KERNEL_FAMILIES:
                raise ValueError(
                    f"--kernel-backend-overrides: unknown family {fam!r}; "
                    f"families: {KERNEL_FAMILIES}"
                )
            if impl not in KERNEL_BACKENDS:
                raise ValueError(
                    f"--kernel-backend-overrides {fam}={impl!r}: choose from {KERNEL_BACKENDS}"
                )

    def of(self, family: str) -> str:
        assert family in KERNEL_FAMILIES, family
        return dict(self.overrides).get(family, self.backend)

    @classmethod
    def parse(
        cls, backend: str, overrides: str | None = None, batch_invariant: bool = False
    ) -> KernelChoice:
        pairs: list[tuple[str, str]] = []
        for item in (overrides or "").split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise ValueError(f"--kernel-backend-overrides expects family=impl, got {item!r}")
            fam, impl = item.split("=", 1)
            pairs.append((fam.strip(), impl.strip()))
        return cls(backend, tuple(pairs), batch_invariant=batch_invariant)
