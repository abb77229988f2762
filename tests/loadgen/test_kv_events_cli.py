"""`python -m loadgen.kv_events` as a tool: it says what it waits for, and prints a
count only once a batch has been applied (never `seq -1`, which reads like the
replay's end marker)."""

from __future__ import annotations

import threading

import pytest
import zmq

from loadgen.kv_events import main
from protocol.kv_events import BlockStored, KVEventBatch, batch_codec, encode_seq


def test_nothing_published_prints_only_the_waiting_line(capsys):
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as pub:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        assert main(["--endpoint", f"tcp://127.0.0.1:{port}", "--duration", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"subscribed to tcp://127.0.0.1:{port}; waiting for the first batch of KV events"]


def test_a_batch_is_counted_from_its_own_sequence_number(capsys):
    stored = BlockStored([11, 12], None, [1] * 32, 16, None, None, None)
    frame = batch_codec().encode(KVEventBatch(1.0, [stored]))
    stop = threading.Event()
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as pub:
        port = pub.bind_to_random_port("tcp://127.0.0.1")

        def publish():  # seq 0 again and again: a SUB joins late; repeats are ignored
            while not stop.wait(0.05):
                pub.send_multipart([b"", encode_seq(0), frame])

        t = threading.Thread(target=publish)
        t.start()
        try:
            assert main(["--endpoint", f"tcp://127.0.0.1:{port}", "--duration", "2"]) == 0
        finally:
            stop.set()
            t.join(5)
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["seq 0: 2 cached block hashes (lost 0)"]
    assert not any("seq -1" in line for line in out)


def test_every_flag_says_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--endpoint", "--replay-endpoint", "--topic", "--curve-secret-key", "--curve-server-key", "--events", "--duration"):
        help_text = out.split(flag, 2)[-1].split(" --", 1)[0]  # after the usage line, up to the next flag
        assert "default" in help_text, (flag, help_text)
