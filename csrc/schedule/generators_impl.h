// One function per schedule family; generate() in generators.cpp checks names and options.
#pragma once

#include "schedule/generators.h"

namespace torchpp::schedule::detail {

// Single stage per rank, built from warm-up forwards, 1F1B steady state and cooldown.
Schedule gpipe(int p, int m);
Schedule one_f_one_b(int p, int m);
Schedule eager_one_f_one_b(int p, int m);
Schedule zb_h1(int p, int m);
Schedule zb_h2(int p, int m);

// v stages per rank, stage c*p + r on rank r.
Schedule interleaved_1f1b(int p, int m, int v, int group_size);
Schedule interleaved_zero_bubble(int p, int m, int v, int group_size);
Schedule looped_bfs(int p, int m, int v);

// Cost- and memory-aware list scheduling (greedy.cpp), searched over its hyperparameters.
// memory_limit bounds M_B per activation plus M_W per pending W on each rank (greedy.h); the
// kept schedule has the shortest makespan, or the shortest longest rank span if span_first.
Schedule zb_auto(int p, int m, const Costs& costs, const MemoryUnits& memory, double memory_limit, bool span_first);
// zb-v, and v-min / v-half given a limit: the shortest V schedule (stages r and 2p-1-r on rank r)
// within memory_limit, from the list scheduler's settings and the building blocks below.
Schedule v_search(const std::string& name, int p, int m, const Costs& costs, const MemoryUnits& memory,
                  double memory_limit, bool span_first);

// The controllable-memory V building blocks (Qi et al. 2024), cost-free like 1F1B: peak memory
// (p+4)//3 (V-Min) and (p+2)//2 (V-Half) microbatches of a rank's layers, F to W.
Schedule v_min(int p, int m);
Schedule v_half(int p, int m);

// DeepSeek's bidirectional schedules.
Schedule dualpipe(int p, int m);
Schedule dualpipe_v(int p, int m);

}  // namespace torchpp::schedule::detail
