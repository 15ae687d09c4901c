"""Save and load fitted estimators without pickle: JSON + safetensors, allowlisted
classes only.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._persistence import (
    ARRAYS_NAME,
    EXTRA_BYTES_PER_BYTE,
    FORMAT,
    FORMAT_VERSION,
    JSON_NAME,
    MAX_EXTRA_BYTES,
    MAX_JSON_DEPTH,
    RUNTIME_PARAMS,
    LoadContext,
    PersistenceMixin,
    allowed_classes,
    load,
    register_class,
    register_model_locator,
    register_value_codec,
    save,
)

__all__ = [
    "ARRAYS_NAME",
    "EXTRA_BYTES_PER_BYTE",
    "FORMAT",
    "FORMAT_VERSION",
    "JSON_NAME",
    "LoadContext",
    "MAX_EXTRA_BYTES",
    "MAX_JSON_DEPTH",
    "PersistenceMixin",
    "RUNTIME_PARAMS",
    "allowed_classes",
    "load",
    "register_class",
    "register_model_locator",
    "register_value_codec",
    "save",
]
