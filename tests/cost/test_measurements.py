"""Reading measurement files for `tessera validate`: the documented CSV, `tessera profile` JSON, Nsight Systems
cuda_gpu_trace exports and the calibration set's TSV, with errors that name the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.cost.gpu_calibration import POINTS_FILE
from tessera.cost.measurements import KERNEL, PAIRED, STEP, TRACE, MeasurementError, read_measurements

PROFILE = Path(__file__).parents[1] / "fixtures" / "profiles" / "smollm2-135m_decode_b8_ctx256_cpu.json"
EXAMPLE_CSV = Path(__file__).parents[2] / "examples" / "measurements" / "cpu_smollm2-135m_decode.csv"
HEADER = "device,model,op,shape,seconds\n"


def write(tmp_path: Path, text: str, name: str = "m.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_documented_csv_rows(tmp_path):
    p = write(tmp_path, "# a comment\n" + HEADER + "A100,llama-3.1-8b,decode,batch=64 ctx=2048,0.0123\n"
              "l40s,llama-3.1-8b,decode/gemm,batch=64;ctx=2048,0.004\ncpu:2,smollm2-135m,prefill,,0.2\n")
    s = read_measurements(p)
    assert s.format == "csv" and [m.kind for m in s.measurements] == [STEP] * 3
    a, b, c = s.measurements
    assert (a.device, a.op_class, a.part, a.seconds, a.where) == ("A100", "step", None, 0.0123, f"{p}:3")
    assert (b.device, b.op_class, b.part) == ("L40S", "gemm", "gemm")
    assert dict(a.shape) == dict(b.shape) == {"batch": 64, "ctx": 2048}
    assert a.key[:4] == b.key[:4] and a.key != b.key  # same step, another part of it
    assert c.device == "cpu" and c.threads is not None and c.shape == ()


def test_example_csv_reads():
    s = read_measurements(EXAMPLE_CSV)
    assert s.format == "csv" and {m.op_class for m in s.measurements} >= {"step", "gemv", "attention"}


@pytest.mark.parametrize("row, message", [
    ("A10O,llama-3.1-8b,decode,batch=8,0.01", "m.csv:2: unknown device 'A10O'"),
    ("A100,llama-9,decode,batch=8,0.01", "m.csv:2:"),
    ("A100,llama-3.1-8b,denoise,batch=8,0.01", "its phases are"),
    ("A100,llama-3.1-8b,decode/matmul,batch=8,0.01", "unknown cost class 'matmul'"),
    ("A100,llama-3.1-8b,decode,batch=eight,0.01", "m.csv:2: shape batch='eight'"),
    ("A100,llama-3.1-8b,decode,rows=8,0.01", "shape item 'rows=8'"),
    ("A100,llama-3.1-8b,decode,batch=8,fast", "m.csv:2: seconds 'fast' is not a number"),
    ("A100,llama-3.1-8b,decode,batch=8,-1", "positive time"),
    ("A100,llama-3.1-8b,decode", "m.csv:2: 3 fields"),
    ("cpu:x,smollm2-135m,decode,,0.1", "cpu:N"),
])
def test_csv_bad_rows_name_file_and_line(tmp_path, row, message):
    p = write(tmp_path, HEADER + row + "\n")
    with pytest.raises(MeasurementError, match=None) as e:
        read_measurements(p)
    assert message in str(e.value)


def test_csv_bad_header_and_unknown_format(tmp_path):
    with pytest.raises(MeasurementError, match=r"m.csv:1: the header lacks column\(s\) op"):
        read_measurements(write(tmp_path, "device,model,kernel,shape,seconds\nA100,x,y,z,1\n"))
    with pytest.raises(MeasurementError, match="m.csv:2: not a measurement file"):
        read_measurements(write(tmp_path, "\nhello world\n"))
    with pytest.raises(MeasurementError, match="empty"):
        read_measurements(write(tmp_path, "# only a comment\n"))
    with pytest.raises(MeasurementError, match="cannot read"):
        read_measurements(tmp_path / "missing.csv")
    with pytest.raises(MeasurementError, match="m.csv: the header has no rows under it"):
        read_measurements(write(tmp_path, HEADER))


def test_calibration_table_errors(tmp_path):
    header = "phase\tcategory\ta100_us\tl40s_us\tkernel\n"
    with pytest.raises(MeasurementError, match=r"t.tsv:2: a100_us 'x' is not a number"):
        read_measurements(write(tmp_path, header + "decode\tffn\tx\t2.0\tgemm_kernel\n", "t.tsv"))
    with pytest.raises(MeasurementError, match=r"t.tsv:1: the calibration table lacks column\(s\) kernel"):
        read_measurements(write(tmp_path, "phase\tcategory\ta100_us\tl40s_us\n", "t.tsv"))
    with pytest.raises(MeasurementError, match=r"t.tsv:2: 3 fields"):
        read_measurements(write(tmp_path, header + "decode\tffn\t1.0\n", "t.tsv"))


def test_profile_kernels():
    s = read_measurements(PROFILE)
    assert s.format == "profile" and len(s.measurements) == 304
    m = s.measurements[0]
    assert m.kind == KERNEL and m.device == "cpu" and m.threads == 1 and m.signature and m.seconds > 0
    assert dict(m.shape) == {"batch": 8, "seq": 1, "ctx": 256}


def test_profile_errors_name_the_file(tmp_path):
    with pytest.raises(MeasurementError, match="not a Tessera profile"):
        read_measurements(write(tmp_path, '{"kind": "other"}', "p.json"))


def test_calibration_points_pair_a100_and_l40s():
    s = read_measurements(POINTS_FILE)
    ref = [m for m in s.measurements if m.reference is None]
    tgt = [m for m in s.measurements if m.reference is not None]
    assert s.format == "calibration" and len(ref) == len(tgt) and len(ref) + len(s.excluded) == 98
    assert {m.device for m in ref} == {"A100-PCIE"} and {m.device for m in tgt} == {"L40S"}
    assert all(m.kind == PAIRED and m.reference.key == m.key for m in tgt)


NSYS = ('Generating SQLite file report.sqlite\nProcessing [report.sqlite] with [cuda_gpu_trace.py]...\n\n'
        '"Start (ns)","Duration (ns)","CorrId","GrdX","Device","Strm","Name"\n'
        '100,2000,1,1,"NVIDIA A100 80GB PCIe (0)",7,"ampere_bf16_s16816gemm_bf16_128x64"\n'
        '200,3000,2,1,"NVIDIA A100 80GB PCIe (0)",7,"ampere_bf16_s16816gemm_bf16_128x64"\n'
        '300,1000,3,1,"NVIDIA A100 80GB PCIe (0)",7,"[CUDA memcpy Host-to-Device]"\n'
        '400,1500,4,1,"NVIDIA L40S (1)",7,"ampere_bf16_s16816gemm_bf16_128x64"\n'
        '500,800,5,1,"NVIDIA L40S (1)",7,"void at::native::softmax_warp_forward<float>"\n')


def test_nsys_export_median_per_device_and_name(tmp_path):
    s = read_measurements(write(tmp_path, NSYS, "trace.csv"))
    assert s.format == "nsys" and len(s.excluded) == 1  # the memcpy row
    by = {(m.device, m.op): m for m in s.measurements}
    a100 = by[("A100-PCIE", "ampere_bf16_s16816gemm_bf16_128x64")]
    assert a100.kind == TRACE and a100.seconds == pytest.approx(2.5e-6) and a100.launches == 2
    assert a100.op_class == "gemm" and a100.where.endswith("trace.csv:5")
    assert by[("L40S", "void at::native::softmax_warp_forward<float>")].op_class == "reduction"
    assert a100.key == by[("L40S", "ampere_bf16_s16816gemm_bf16_128x64")].key


def test_nsys_errors(tmp_path):
    bad_device = NSYS.replace("NVIDIA L40S (1)", "Imaginary GPU (1)")
    with pytest.raises(MeasurementError, match=r"trace.csv:8: unknown device 'Imaginary GPU'"):
        read_measurements(write(tmp_path, bad_device, "trace.csv"))
    no_device = '"Start (ns)","Duration (ns)","Name"\n1,2,"k"\n'
    with pytest.raises(MeasurementError, match="trace.csv:1: no 'Device' column"):
        read_measurements(write(tmp_path, no_device, "trace.csv"))
    bad_time = NSYS.replace("1500", "soon")
    with pytest.raises(MeasurementError, match=r"trace.csv:8: Duration \(ns\) 'soon' is not a number"):
        read_measurements(write(tmp_path, bad_time, "trace.csv"))
