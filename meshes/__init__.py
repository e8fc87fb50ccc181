"""Named mesh presets. `get(name)` returns a `MeshConfig`; `PRESETS` lists them all.

| name      | devices | layout                                   | hardware |
|-----------|---------|------------------------------------------|----------|
| cpu8      | 8       | dp=2 x fsdp=2 x tp=2 (simulated CPU)     | cpu      |
| cpu1      | 1       | single device                            | cpu      |
| h200x1    | 1       | single H200                              | h200     |
| h100x8    | 8       | fsdp=8 inside one NVLink node            | h100     |
| h100x8x2  | 16      | 2 nodes: dp=2 across, fsdp=8 inside      | h100     |
| h100x8x4  | 32      | 4 nodes: dp=4 across, fsdp=2 x tp=4 in   | h100     |
"""
from jaxscale.mesh import MeshConfig

PRESETS: dict[str, MeshConfig] = {
    "cpu8": MeshConfig(dp=2, fsdp=2, tp=2, device_kind="cpu"),
    "cpu1": MeshConfig(device_kind="cpu"),
    "h200x1": MeshConfig(device_kind="h200"),
    "h100x8": MeshConfig(fsdp=8, device_kind="h100"),
    "h100x8x2": MeshConfig(dp=2, fsdp=8, dcn_dp=2, device_kind="h100"),
    "h100x8x4": MeshConfig(dp=4, fsdp=2, tp=4, dcn_dp=4, device_kind="h100"),
}


def get(name: str) -> MeshConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown mesh preset {name!r}; valid: {', '.join(PRESETS)}") from None
