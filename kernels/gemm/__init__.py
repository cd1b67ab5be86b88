# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Skinny (M <= 16) bf16 GEMM with fused decode epilogues for SM90.

``kernel`` holds the device code, ``prepared`` the weight binding, packing,
compile cache and graph-capturable launch.  Import those submodules
explicitly; this package does not import cutlass on its own.
"""
