"""Op implementations; importing this package registers every backend."""
from . import matmul  # noqa: F401
