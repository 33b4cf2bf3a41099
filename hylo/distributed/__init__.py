"""Communication between ranks, kept apart from the solver math."""

from hylo.distributed.comm import Communicator, LocalCommunicator, TorchCommunicator, default_communicator

__all__ = ["Communicator", "LocalCommunicator", "TorchCommunicator", "default_communicator"]
