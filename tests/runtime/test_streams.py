"""devices= with CUDA streams (runtime/streams.py): what is accepted, what is refused with which message, how a
stream device prints, SM slice sizes, and how the streams follow the stages of each schedule. What needs a GPU (the
streams themselves, green contexts, the events between streams) is tests/runtime/test_cuda.py's."""
import re

import pytest
import torch

import autopipe
from autopipe.devices import device_streams, resolve_devices
from autopipe.options import Options
from autopipe.ir.schedule import device_of_stage
from autopipe.runtime.streams import StageStream, as_stage_stream, check_stream_device, slice_size, stream_label


def test_a_stream_on_a_gpu_of_this_host_is_its_device():
    assert check_stream_device(torch.device("cuda", 1), 2, "s") == torch.device("cuda", 1)


@pytest.mark.parametrize("device, count, message", [
    (torch.device("cpu"), 0, "s is a cpu stream: autopipe puts stages on CUDA streams"),
    (torch.device("cuda", 0), 0, "s is a CUDA stream but CUDA is not available here"),
    (torch.device("cuda", 2), 2, "s is on cuda:2, which does not exist: this host has 2 CUDA device(s) "
                                 "(cuda:0..cuda:1)"),
])
def test_a_stream_off_this_hosts_gpus_is_refused(device, count, message):
    with pytest.raises(ValueError, match="^" + re.escape(f"devices: {message}")):
        check_stream_device(device, count, "s")


def test_a_cpu_stream_in_devices_is_refused_before_anything_is_traced():
    stream = torch.Stream("cpu")
    with pytest.raises(ValueError, match="is a cpu stream: autopipe puts stages on CUDA streams"):
        resolve_devices(["cpu", stream])
    with pytest.raises(ValueError, match="is a cpu stream"):
        autopipe.compile(torch.nn.Linear(4, 4), devices=[stream, "cpu"], example_inputs=(torch.randn(2, 4),))


def test_devices_that_are_not_streams_are_left_to_resolve_devices():
    for entry in ("cpu", "cuda:0", torch.device("cpu"), 3):
        assert as_stage_stream(entry, 1) is None
    assert device_streams(["cpu", "cpu"]) == () and device_streams(4) == ()
    assert resolve_devices(["cpu", torch.device("cpu")]) == [torch.device("cpu")] * 2


def test_a_stream_device_prints_its_gpu_stream_and_slice():
    assert stream_label(torch.device("cuda", 0), 0x7F3A00, 32) == "cuda:0 stream 0x7f3a00 (green context, 32 SMs)"
    assert stream_label(torch.device("cuda", 1), 0x10, None) == "cuda:1 stream 0x10 (all SMs)"


@pytest.mark.parametrize("total, k, major, size", [
    (132, 2, 9, 64), (132, 4, 9, 32), (132, 3, 9, 40), (132, 16, 9, 8), (108, 4, 8, 26), (80, 4, 7, 20),
])
def test_slices_are_equal_multiples_of_the_split_granularity_that_fit(total, k, major, size):
    assert slice_size(total, k, major) == size
    assert k * size <= total


def test_too_many_slices_are_refused_with_the_most_that_fit():
    with pytest.raises(ValueError, match="17 slices of a GPU with 132 SMs would have 7 SMs each; a green context "
                                         "needs at least 8 .* use at most 16 slices"):
        slice_size(132, 17, 9)
    with pytest.raises(ValueError, match="k must be a positive int"):
        slice_size(132, 0, 9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_sm_slices_without_a_gpu_say_so():
    with pytest.raises(RuntimeError, match="sm_slices: cuda:0 is not a CUDA device here"):
        autopipe.sm_slices(2)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("interleaved", 2), ("zbv", 1)])
def test_each_stage_gets_the_stream_of_its_device_in_every_schedule(schedule, virtual):
    """Options.make lays stages on the K entries of devices= by the schedule (zbv: a V); their streams follow."""
    K = 2
    streams = tuple(StageStream(torch.device("cuda", 0), torch.Stream("cpu")) for _ in range(K))
    options = Options.make([torch.device("cpu")] * K, streams=streams, schedule=schedule, virtual_stages=virtual)
    assert len(options.streams) == len(options.devices) == K * options.virtual_stages
    for s, stream in enumerate(options.streams):
        assert stream is streams[device_of_stage(schedule, K, s)]
    with pytest.raises(ValueError, match="1 streams for 2 devices"):
        Options.make([torch.device("cpu")] * K, streams=streams[:1])
