# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode step's first launch: embedding rows and the first RMSNorm, fused.

``kernel`` holds the device code, ``prepared`` the weight binding, compile
cache and graph-capturable launch.  Import those submodules explicitly; this
package does not import cutlass on its own.
"""
