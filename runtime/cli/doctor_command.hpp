// `shardflow doctor`: what on this machine would make a job slow, wrong or hang, each with its fix
// (runtime/cli/doctor_checks.hpp). Exit 1 when something would break a job; --json for scripts.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace shardflow::cli {

// Adds the subcommand to `app`; the returned function runs it once parsed (exit status, -1 when
// another subcommand was given).
std::function<int()> add_doctor_command(CLI::App& app);

}  // namespace shardflow::cli
