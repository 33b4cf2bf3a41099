"""Communication between ranks and work assignment, kept apart from the solver math."""

from hylo.distributed.assignment import assign_owners, rank_loads
from hylo.distributed.comm import (
    CommunicationError,
    Communicator,
    LocalCommunicator,
    Pending,
    TorchCommunicator,
    default_communicator,
)

__all__ = [
    "CommunicationError",
    "Communicator",
    "LocalCommunicator",
    "Pending",
    "TorchCommunicator",
    "assign_owners",
    "default_communicator",
    "rank_loads",
]
