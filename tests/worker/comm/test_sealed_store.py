from datetime import timedelta

import pytest
import torch.distributed as dist

from spark_estimator.shared.spec import launch_secret
from spark_estimator.worker.comm.sealed_store import ForgedValue, SealedStore

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def server():
    """A real TCPStore server on a free port (what rank 0 serves)."""
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=TIMEOUT)


def client(server):
    """Another process's view of the port: a plain TCPStore client, as a stranger has."""
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def test_the_ranks_read_what_they_wrote_and_a_client_of_the_port_reads_random_bytes(server):
    secret = launch_secret()
    rank_0, rank_1 = SealedStore(server, secret), SealedStore(client(server), secret)
    rank_0.set("addr/0", b"127.0.0.1:29500")
    rank_0.set("text", "1")
    assert rank_1.get("addr/0") == b"127.0.0.1:29500" and rank_1.get("text") == b"1"
    rank_1.wait(["addr/0"], TIMEOUT)
    assert rank_1.check(["addr/0", "text"]) and rank_1.num_keys() == server.num_keys()
    stored = client(server).get("addr/0")
    assert b"127.0.0.1" not in stored and secret.encode() not in stored
    # a fresh nonce each time: the same value is stored differently
    rank_0.set("addr/0", b"127.0.0.1:29500")
    assert client(server).get("addr/0") != stored


def test_a_value_that_no_rank_of_the_launch_wrote_is_refused(server):
    secret = launch_secret()
    rank = SealedStore(client(server), secret)
    stranger = client(server)
    stranger.set("addr/1", b"10.6.6.6:29500")  # a stranger's own address
    with pytest.raises(ForgedValue, match="'addr/1'.*no rank of this launch wrote"):
        rank.get("addr/1")
    rank.set("addr/0", b"127.0.0.1:29500")
    stranger.set("addr/1", stranger.get("addr/0"))  # a rank's value, under another key
    with pytest.raises(ForgedValue):
        rank.get("addr/1")
    tampered = bytearray(stranger.get("addr/0"))
    tampered[20] ^= 1  # one bit of the ciphertext
    stranger.set("addr/0", bytes(tampered))
    with pytest.raises(ForgedValue):
        rank.get("addr/0")
    stranger.set("addr/0", b"")
    with pytest.raises(ForgedValue):
        rank.get("addr/0")
    # a value sealed in another launch (another secret) does not pass in this one
    SealedStore(client(server), launch_secret()).set("addr/0", b"127.0.0.1:29500")
    with pytest.raises(ForgedValue):
        rank.get("addr/0")


def test_counters_are_the_servers_own_counts(server):
    rank = SealedStore(client(server), launch_secret())
    assert rank.add("failures", 1) == 1 and rank.add("failures", 1) == 2
    assert rank.get("failures") == b"2"  # read back as torch's store barrier does
    assert client(server).add("failures", 1) == 3
