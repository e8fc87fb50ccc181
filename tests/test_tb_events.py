"""The TensorBoard event files a run writes, read back with an independent reader: tensorboardX's
compiled protocol buffers and its CRC-32C."""
import struct

import pytest
from tensorboardX.crc32c import crc32c as reference_crc32c
from tensorboardX.proto.event_pb2 import Event, SessionLog

from jaxscale.train import tb_events
from jaxscale.train.metrics import MetricsWriter


def masked(data: bytes) -> int:
    c = reference_crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path) -> list[Event]:
    """Every record of a TFRecord file, its two checksums verified, parsed as an `Event`."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at:at + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked(header)
        body = data[at + 12:at + 12 + n]
        assert struct.unpack("<I", data[at + 12 + n:at + 16 + n])[0] == masked(body)
        events.append(Event.FromString(body))
        at += 16 + n
    return events


@pytest.mark.parametrize("data", [b"", b"a", b"123456789", bytes(range(256)) * 3])
def test_crc32c_is_castagnolis(data):
    assert tb_events.crc32c(data) == reference_crc32c(data)
    assert tb_events.crc32c(b"123456789") == 0xE3069283          # the check value


def test_a_runs_scalars_and_a_resumes_purge_read_back(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write({"step": 1, "loss": 5.25, "lr": 1e-3, "event": "spike", "tokens": 2 ** 40})
    w.write({"step": 2, "loss": -0.5, "grad_norm": float("inf")})
    w.close()
    (first,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    version, one, two = read_events(first)
    assert version.file_version == "brain.Event:2"
    assert one.step == 1 and {v.tag: v.simple_value for v in one.summary.value} == {
        "loss": 5.25, "lr": pytest.approx(1e-3), "tokens": 2.0 ** 40}
    assert two.step == 2 and [(v.tag, v.simple_value) for v in two.summary.value] == [
        ("loss", -0.5), ("grad_norm", float("inf"))]

    w = MetricsWriter(tmp_path, resume_step=1)        # resumed after step 1: step 2 is purged
    w.write({"step": 2, "loss": 4.0})
    w.close()
    (second,) = set((tmp_path / "tb").glob("events.out.tfevents.*")) - {first}
    version, purge, again = read_events(second)
    assert purge.step == 2 and purge.session_log.status == SessionLog.START
    assert again.step == 2 and again.summary.value[0].simple_value == 4.0
    assert [r["step"] for r in
            map(__import__("json").loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            ] == [1, 2]


def test_a_negative_step_is_encoded_as_int64():
    assert Event.FromString(tb_events.event(-3)).step == -3
