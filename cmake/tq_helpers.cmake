# tq_add_test(name SOURCES ... LIBS ...): one GoogleTest binary, registered test by test with CTest.
include(GoogleTest OPTIONAL RESULT_VARIABLE _tq_have_gtest_module)
function(tq_add_test name)
  if(NOT TQ_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main hwy::hwy_test)
  # Tests find the project's fixtures under TQ_SOURCE_DIR and the shared data (models, tokenizers,
  # templates) under TQ_SHARED_DIR; tests that need shared data skip with a message when it is absent.
  target_compile_definitions(${name} PRIVATE TQ_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                             TQ_SHARED_DIR="${PROJECT_SOURCE_DIR}/../shared")
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES ENVIRONMENT "TQ_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
endfunction()
