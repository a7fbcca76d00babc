"""Which implementation each op family uses: `--kernel-backend {torch,triton}` plus optional
per-family overrides (`--kernel-backend-overrides moe=torch,rope=triton`).

Layers resolve their callables from this record once, when they are built: the path
a deployment runs is visible in its command line, never chosen by tensor device or env var.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def parse(cls, backend: str, overrides: str | None = None) -> KernelChoice:
        pairs: list[tuple[str, str]] = []
        for item in (overrides or "").split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise ValueError(f"--kernel-backend-overrides expects family=impl, got {item!r}")
            fam, impl = item.split("=", 1)
            pairs.append((fam.strip(), impl.strip()))
        return cls(backend, tuple(pairs))
