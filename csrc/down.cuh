// down task: RESID[:, rows] = RESID[:, rows] + ACT @ Wdown[rows]^T (K = intermediate size).
// Same epilogue as o_proj (residual add); only the weight plan differs (matvec_plan.cuh weight_plan).
#pragma once
#include "o_proj.cuh"
