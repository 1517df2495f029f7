import gc
from datetime import timedelta

import pytest
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from spark_estimator.shared.spec import launch_secret
from spark_estimator.worker.comm.sealed_store import ForgedValue, SealedStore

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def server():
    """A real TCPStore server on a free port (what rank 0 serves)."""
    yield dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=TIMEOUT)
    # stopped now, not when the cycles of an expected error's traceback are collected: a
    # client's connection times out in a process that still serves a dozen of them
    gc.collect()


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


def test_values_are_sealed_with_chacha20_poly1305_under_a_key_derived_by_hkdf(server):
    # the field's construction, from a maintained library: "~" | nonce | ciphertext | tag,
    # the key name as associated data, the key derived from the launch's secret by HKDF
    secret = launch_secret()
    SealedStore(server, secret).set("addr/0", b"127.0.0.1:29500")
    stored = client(server).get("addr/0")
    assert len(stored) == 1 + 12 + len(b"127.0.0.1:29500") + 16 and stored[:1] == b"~"
    key = HKDF(hashes.SHA256(), 32, None, b"spark-estimator store: ChaCha20-Poly1305").derive(
        secret.encode()
    )
    aead = ChaCha20Poly1305(key)
    assert aead.decrypt(stored[1:13], stored[13:], b"addr/0") == b"127.0.0.1:29500"


def test_counters_are_sealed_counts_that_a_client_of_the_port_cannot_read(server):
    rank = SealedStore(client(server), launch_secret())
    assert rank.add("failures", 1) == 1 and rank.add("failures", 1) == 2
    assert rank.add("failures", 0) == 2
    assert rank.get("failures") == b"2"  # read back as torch's store barrier does
    assert client(server).get("failures") not in (b"1", b"2")
    assert SealedStore(client(server), launch_secret()).add("other", 5) == 5


@pytest.mark.parametrize("poison", [b"not-a-number", b"1", b""])
def test_a_counter_a_stranger_overwrote_is_refused_and_the_ranks_store_still_answers(
    server, poison
):
    secret = launch_secret()
    rank, stranger = SealedStore(client(server), secret), client(server)
    rank.add("failures", 1)
    stranger.set("failures", poison)
    stranger.get("failures")  # the server has taken it
    # neither torch's "Did the remote server shutdown" (the server closes the connection
    # of an add to a value that is not a number) nor a count the stranger chose
    with pytest.raises(ForgedValue, match="'failures'.*no rank of this launch wrote"):
        rank.add("failures", 1)
    rank.set("after", b"still answers")
    assert rank.get("after") == b"still answers"
    # replaced where asked (``meeting.first_failure``): counted from 0 again
    assert rank.add("failures", 1, replace_forged=True) == 1
    assert rank.add("failures", 1) == 2


def test_a_strangers_add_to_a_sealed_counter_leaves_the_count(server):
    secret = launch_secret()
    rank = SealedStore(client(server), secret)
    assert rank.add("arrivals", 1) == 1
    stranger = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=0.5)
    )
    with pytest.raises(dist.DistError):  # a sealed count is no number to the server
        stranger.add("arrivals", 5)
    assert rank.add("arrivals", 1) == 2


def test_a_strangers_add_fails_whatever_random_bytes_the_sealed_count_begins_with(
    server, monkeypatch
):
    """The server reads a stored value as a number from its leading digits: a sealed count
    whose random nonce begins with one was a number to it (1 count in about 25)."""
    from spark_estimator.worker.comm import sealed_store

    monkeypatch.setattr(sealed_store.os, "urandom", lambda n: b"1" + bytes(n - 1))
    rank = SealedStore(client(server), launch_secret())
    assert rank.add("arrivals", 1) == 1
    stranger = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=0.5)
    )
    with pytest.raises(dist.DistError):
        stranger.add("arrivals", 5)
    assert rank.add("arrivals", 1) == 2


def test_compare_set_append_multi_get_multi_set_and_clone_work_on_sealed_values(server):
    secret = launch_secret()
    rank_0, rank_1 = SealedStore(server, secret), SealedStore(client(server), secret)
    # torch's compare_set: an absent key is set only when nothing is expected
    assert rank_0.compare_set("k", b"x", b"y") == b"x" and not rank_0.check(["k"])
    assert rank_0.compare_set("k", b"", b"first") == b"first"
    assert rank_1.compare_set("k", b"other", b"no") == b"first"  # compares plaintexts
    assert rank_1.compare_set("k", "first", "second") == b"second"
    assert rank_0.get("k") == b"second" and b"second" not in client(server).get("k")
    rank_0.append("log", b"a")
    rank_1.append("log", "b")
    assert rank_0.get("log") == b"ab" and b"ab" not in client(server).get("log")
    rank_0.multi_set(["m/0", "m/1"], [b"zero", "one"])
    assert rank_1.multi_get(["m/0", "m/1"]) == [b"zero", b"one"]
    assert rank_1.clone().get("m/1") == b"one"
    stranger = client(server)
    stranger.set("k", b"second")
    with pytest.raises(ForgedValue):
        rank_0.compare_set("k", b"second", b"third")
    with pytest.raises(ForgedValue):
        rank_0.append("k", b"more")
    assert stranger.get("k") == b"second"  # left as it was
