# moeflow._autograd: the torch autograd nodes in C++ (python/src/torch_nodes.cpp),
# built against the torch that the Python found imports: its headers,
# libtorch and the pybind11 it ships. AUTO: built when that torch imports
# and uses the C++11 ABI; OFF: moeflow.ops uses its Python nodes only.
# `pip install .` builds in an isolated environment without torch, so it
# skips this module; `pip install --no-build-isolation .` builds it against
# the environment's torch.
set(MOEFLOW_BUILD_TORCH_NODES AUTO CACHE STRING
    "Build moeflow._autograd (torch autograd nodes in C++): AUTO, ON or OFF")
if(NOT MOEFLOW_BUILD_TORCH_NODES STREQUAL "OFF")
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c
      "import os, torch; d = os.path.dirname(torch.__file__); print(d); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
    OUTPUT_VARIABLE _moeflow_torch RESULT_VARIABLE _moeflow_torch_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(_moeflow_torch_ok FALSE)
  set(_moeflow_torch_why "no torch with headers at build time")
  if(_moeflow_torch_rc EQUAL 0)
    string(REPLACE "\n" ";" _moeflow_torch "${_moeflow_torch}")
    list(GET _moeflow_torch 0 _moeflow_torch_dir)
    list(GET _moeflow_torch 1 _moeflow_torch_abi)
    list(GET _moeflow_torch 2 _moeflow_torch_version)
    set(_moeflow_torch_libs torch torch_cpu c10 torch_python)
    if(MOEFLOW_WITH_CUDA)
      list(APPEND _moeflow_torch_libs c10_cuda)
    endif()
    set(_moeflow_torch_paths "")
    foreach(_lib ${_moeflow_torch_libs})
      find_library(_moeflow_torch_lib_${_lib} NAMES ${_lib} PATHS ${_moeflow_torch_dir}/lib
                   NO_DEFAULT_PATH NO_CACHE)
      if(_moeflow_torch_lib_${_lib})
        list(APPEND _moeflow_torch_paths ${_moeflow_torch_lib_${_lib}})
      endif()
    endforeach()
    list(LENGTH _moeflow_torch_libs _n_want)
    list(LENGTH _moeflow_torch_paths _n_found)
    if(NOT _moeflow_torch_abi EQUAL 1)
      set(_moeflow_torch_why "torch ${_moeflow_torch_version} uses the pre-C++11 ABI")
    elseif(NOT EXISTS ${_moeflow_torch_dir}/include/torch/csrc/autograd/custom_function.h)
      set(_moeflow_torch_why "torch ${_moeflow_torch_version} has no C++ headers")
    elseif(NOT _n_found EQUAL _n_want)
      set(_moeflow_torch_why "torch ${_moeflow_torch_version} lacks one of ${_moeflow_torch_libs}")
    elseif(NOT "cxx_std_20" IN_LIST CMAKE_CXX_COMPILE_FEATURES)
      set(_moeflow_torch_why "the C++ compiler has no C++20, which torch's headers need")
    else()
      set(_moeflow_torch_ok TRUE)
    endif()
  endif()
  if(_moeflow_torch_ok)
    Python_add_library(_autograd MODULE WITH_SOABI python/src/torch_nodes.cpp
                       python/src/torch_router_node.cpp python/src/torch_mlp.cpp)
    # recent torch headers need C++20; the rest of moeflow stays C++17.
    set_target_properties(_autograd PROPERTIES CXX_STANDARD 20 CXX_VISIBILITY_PRESET hidden
                          LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/python/moeflow
                          BUILD_RPATH ${_moeflow_torch_dir}/lib
                          INSTALL_RPATH "$ORIGIN/../torch/lib")
    target_include_directories(_autograd SYSTEM PRIVATE
      ${_moeflow_torch_dir}/include ${_moeflow_torch_dir}/include/torch/csrc/api/include)
    target_compile_definitions(_autograd PRIVATE _GLIBCXX_USE_CXX11_ABI=1
                               MOEFLOW_TORCH_VERSION="${_moeflow_torch_version}")
    target_link_libraries(_autograd PRIVATE moeflow ${_moeflow_torch_paths})
    if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
      target_link_options(_autograd PRIVATE "LINKER:--exclude-libs,ALL")
    endif()
    add_dependencies(moeflow_python_files _autograd)
    install(TARGETS _autograd LIBRARY DESTINATION moeflow)
    message(STATUS "moeflow: torch autograd nodes in C++ (torch ${_moeflow_torch_version})")
  elseif(MOEFLOW_BUILD_TORCH_NODES STREQUAL "ON")
    message(FATAL_ERROR "MOEFLOW_BUILD_TORCH_NODES=ON but ${_moeflow_torch_why} "
                        "(${Python_EXECUTABLE})")
  else()
    message(STATUS "moeflow: no torch autograd nodes in C++ (${_moeflow_torch_why}: "
                   "moeflow.ops uses its Python nodes)")
  endif()
endif()
