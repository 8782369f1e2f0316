"""Where the scripts spend their server time: instrumented copies of submit.lua and claim.lua."""
