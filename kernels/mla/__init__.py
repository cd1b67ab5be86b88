# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLA decode pieces for SM90: the new latent-cache row of each request.

``kernel`` holds the device code, ``prepared`` the cache binding, compile
cache and graph-capturable launch.  Import those submodules explicitly; this
package does not import cutlass on its own.
"""
