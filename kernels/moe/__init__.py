# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small-batch (M <= 16) MoE block for SM90: router, experts, combine.

``kernel`` holds the device code, ``prepared`` the weight binding, workspace,
compile cache and graph-capturable launch.  Import those submodules
explicitly; this package does not import cutlass on its own.
"""
