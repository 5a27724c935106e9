"""Op implementations; importing this package registers every backend."""
from . import matmul  # noqa: F401
from . import linear_logprob  # noqa: F401
from . import linear_sample  # noqa: F401
from . import bmm  # noqa: F401
from . import norms  # noqa: F401
from . import softmax  # noqa: F401
from . import attention  # noqa: F401
from . import moe  # noqa: F401
