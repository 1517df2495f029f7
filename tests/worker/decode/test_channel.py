"""Messages with file descriptors between a rank and its decode processes."""

import os
import socket

from spark_estimator.worker.decode.channel import Channel


def test_a_message_carries_descriptors_which_arrive_close_on_exec():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read, write = os.pipe()
    os.set_inheritable(write, True)
    Channel(a).send(("hello", list(range(10_000))), (write,))
    message, fds = Channel(b).recv()
    assert message == ("hello", list(range(10_000))) and len(fds) == 1
    assert not os.get_inheritable(fds[0])  # a process the rank starts does not inherit it
    os.write(fds[0], b"x")
    assert os.read(read, 1) == b"x"
