"""Entry point for `kopf run -m persia_operator.kopf_app --standalone [-A | -n NS]`.

Registers the handlers on kopf's default registry, configured from the environment
(PERSIA_OPERATOR_* variables, see config.py). `persia-operator run` is equivalent and
also sets the liveness endpoint and scope from its own flags.
"""

import kopf

from .config import OperatorConfig
from .handlers import register

reconciler = register(kopf.get_default_registry(), OperatorConfig.from_env())
