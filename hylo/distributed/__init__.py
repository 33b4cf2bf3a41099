"""Communication between ranks and work assignment, kept apart from the solver math."""

from hylo.distributed.assignment import assign_owners
from hylo.distributed.comm import (
    BucketedCommunicator,
    CollectiveBackend,
    CommunicationError,
    Communicator,
    LocalCommunicator,
    Pending,
    TorchBackend,
    TorchCommunicator,
    default_communicator,
)

__all__ = [
    "BucketedCommunicator",
    "CollectiveBackend",
    "CommunicationError",
    "Communicator",
    "LocalCommunicator",
    "Pending",
    "TorchBackend",
    "TorchCommunicator",
    "assign_owners",
    "default_communicator",
]
