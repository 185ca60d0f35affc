module matrixpool.dev/tools/pause

go 1.22
