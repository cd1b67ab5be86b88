# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host-side helpers shared by the CuTe DSL kernels (raw pointers, streams)."""
