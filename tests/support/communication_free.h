// The communication-free cluster the schedule tests measure closed forms on: one node of `gpus`
// GPUs whose links take no time (tests/data/ideal.yaml), and a cost model in which only matmuls
// cost time, all at one efficiency, so pipeline stages of equal layers are balanced.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/program.h"
#include "core/topology.h"

namespace nnsim::testing {

inline Topology communication_free_node(int gpus) {
  Expected<Topology> t = load_topology(std::string(NNSIM_TEST_DATA) + "/ideal.yaml");
  EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message());
  if (!t) return {};
  t->gpus_per_node = gpus;
  t->nics.resize(1);
  t->nics[0].gpus.clear();
  for (int g = 0; g < gpus; ++g) t->nics[0].gpus.push_back(g);
  EXPECT_TRUE(validate_topology(*t).ok());
  return *t;
}

// Memory-bound operators and kernel launches free; matmuls at one efficiency whatever their
// shape (the head's tiny vocabulary would otherwise leave most of the GPU idle and unbalance the
// last stage); communication ideal.
inline CompileOptions matmul_only(const Topology& t) {
  CompileOptions co;
  co.use_default_compute_model = false;
  co.compute_model = ComputeModel::defaults_for(t.gpu);
  co.compute_model.kernel_overhead = 0;
  co.compute_model.memory_efficiency = 1e12;
  co.compute_model.comm_interference = 0;
  co.compute_model.tiles = {{1, 1, 1.0}};
  co.compute_model.gemm_k_half = 0;
  co.use_default_comm_model = false;
  co.comm_model = CommModel::ideal();
  return co;
}

}  // namespace nnsim::testing
