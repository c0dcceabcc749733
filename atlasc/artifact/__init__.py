"""The `.atlas` file format: manifest dataclasses, writer and reader (standard library + numpy only).

    write_artifact(path, manifest, members, weights) -> Manifest   # atomic, byte-deterministic
    open_artifact(path, verify=True) -> Artifact                   # validated; ArtifactError otherwise

See writer.py for the archive layout and manifest.py for the manifest's fields.
"""

from .manifest import (
    FORMAT_VERSION,
    KV_LAYOUT,
    MAGIC,
    EntrySpec,
    IOSpec,
    KVCacheSpec,
    Manifest,
    MemberSpec,
    MemorySpec,
    NodeSpec,
    RegionSpec,
    SourceInfo,
    TENSOR_MAP_BYTES,
    SymbolSpec,
    TensorMapSpec,
    ValueSpec,
    VariantSpec,
    WeightSpec,
)
from .reader import Artifact, arch_name, open_artifact
from .writer import WEIGHTS_ALIGNMENT, WeightsImage, cubin_member, manifest_bytes, write_artifact

__all__ = [
    "FORMAT_VERSION", "KV_LAYOUT", "MAGIC", "TENSOR_MAP_BYTES", "WEIGHTS_ALIGNMENT",
    "Artifact", "EntrySpec", "IOSpec", "KVCacheSpec", "Manifest", "MemberSpec", "MemorySpec", "NodeSpec",
    "RegionSpec", "VariantSpec", "SourceInfo", "SymbolSpec", "TensorMapSpec", "ValueSpec", "WeightSpec", "WeightsImage",
    "arch_name", "cubin_member", "manifest_bytes", "open_artifact", "write_artifact",
]
