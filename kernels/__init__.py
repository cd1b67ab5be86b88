# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CuTe DSL kernels for the SM90 latency-specialized Kimi-Linear decode.

Imports only torch, cutlass and cuda; nothing here imports vLLM.
"""
